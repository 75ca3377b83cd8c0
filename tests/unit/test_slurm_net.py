"""IP literals for whatever binds; the Ray address publisher."""

from __future__ import annotations

import pytest

from milepost.slurm.net import ip_literal, url_host
from milepost.slurm.ray_join import publish


@pytest.mark.parametrize("host, ip", [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1"),
                                      ("localhost", "127.0.0.1")])
def test_ip_literal_resolves_names_and_keeps_literals(host, ip):
    assert ip_literal(host) == ip


def test_unresolvable_host_says_what_to_do():
    with pytest.raises(ValueError, match="give the node's IP address"):
        ip_literal("no-such-host.invalid")


def test_url_host_brackets_ipv6_only():
    assert url_host("::1") == "[::1]"
    assert url_host("10.0.0.1") == "10.0.0.1"
    assert url_host("node-12") == "node-12"


def test_publish_writes_the_whole_address_atomically(tmp_path):
    target = tmp_path / "sub dir" / "it's the address"
    publish(target, "10.1.2.3:20000")
    publish(target, "10.1.2.4:20000")
    assert target.read_text() == "10.1.2.4:20000"
    assert [p.name for p in target.parent.iterdir()] == [target.name]
