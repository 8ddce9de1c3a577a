"""The edge's artefact cache serves a delta only from the base the device's token names (its order's base),
whether the patch is cached or not: a patch from other bytes would reveal those bytes."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from tests.edge.test_edge_artifacts import Edge, HubArtefacts, cached, edge, hub, sha, signing  # noqa: F401 - fixtures


def test_a_delta_from_a_base_the_token_does_not_name_is_403_cached_or_not(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare: the device runs "version 1"; another device's order (base "secret") warmed the cache
    mine, secret = sha(b"version 1"), sha(b"secret")
    hub.deltas[("art-2", mine)] = b"BSDIFF40 mine " * 10
    hub.deltas[("art-2", secret)] = b"BSDIFF40 secret " * 10
    warm = edge.get(f"/api/v1/artifacts/art-2/delta?from={secret}", hub.token("art-2", device="d-other", base=secret))
    assert warm.status_code == 200
    token = hub.token("art-2", base=mine)

    # Execute
    cached_leak = edge.get(f"/api/v1/artifacts/art-2/delta?from={secret}", token)
    uncached_leak = edge.get(f"/api/v1/artifacts/art-2/delta?from={'7' * 64}", token)
    no_base = edge.get(f"/api/v1/artifacts/art-2/delta?from={mine}", hub.token("art-2"))
    entitled = edge.get(f"/api/v1/artifacts/art-2/delta?from={mine}", token)

    # Assert
    for refused in (cached_leak, uncached_leak, no_base):
        assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
    assert (entitled.status_code, entitled.content) == (200, hub.deltas[("art-2", mine)])
    asked = [parse_qs(urlsplit(path).query)["from"][0] for path, _ in hub.requests if urlsplit(path).path.endswith("/delta")]
    assert asked == [secret, mine]  # the refused ones never reached the hub
    assert cached(edge.cache) == {sha(hub.deltas[("art-2", secret)]), sha(hub.deltas[("art-2", mine)])}
