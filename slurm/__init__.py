"""How work reaches compute: Slurm through submitit, or local processes.

    executor.py        the Executor / JobHandle interface every block stage uses
    slurm_executor.py  SlurmExecutor (sbatch through submitit)
    local.py           LocalExecutor (the embedded default)
    options.py         SlurmOptions (`cluster.slurm` of a recipe) and per-job Resources
    checkpointable.py  CheckpointableStage / requeueable(): requeued on preemption/timeout
    state.py           Slurm state → Outcome; async poller (the Airflow trigger's core)
    sbatch.py          the Ray-on-Slurm allocation script; ray_join.py publishes its address
    net.py             IP literals for whatever binds
    devcluster.sh      a real single-machine Slurm cluster for development and CI
"""
