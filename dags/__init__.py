"""Airflow orchestration of milepost campaigns (`milepost.dags`): the DAG factory
(factory.py), the stage operator (operators.py), the deferrable stage-job trigger
(triggers.py), the trigger form's schema (params.py), and the DAG file itself
(campaigns.py; the other modules are listed in .airflowignore)."""
