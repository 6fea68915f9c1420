"""deploy/kubernetes/disaggregated: the gpu overlay's executors in prefill mode and a
decode Deployment written out whole (kustomize cannot copy one), rendered with the other
overlays by tests/test_kubernetes.py's fixture; the generic checks run there."""

from __future__ import annotations

import json

from test_kubernetes import (  # noqa: F401 - `rendered` is the module's fixture
    EXECUTOR_LABELS,
    FLAG_TYPES,
    ROLE,
    _container,
    _one,
    rendered,
)


def test_disaggregated_overlay_runs_prefill_and_decode_executors_alike(rendered):  # noqa: F811
    """The decode Deployment is written out whole (kustomize cannot copy one): it must stay
    the gpu overlay's executor in everything but its name, its role label and its mode."""
    objects = rendered["disaggregated"]
    prefill = _one(objects, "Deployment", "pagedserve-executor")
    decode = _one(objects, "Deployment", "pagedserve-executor-decode")
    assert prefill["spec"]["selector"]["matchLabels"][ROLE] == "prefill"
    assert decode["spec"]["selector"]["matchLabels"] == EXECUTOR_LABELS | {ROLE: "decode"}
    assert "replicas" not in decode["spec"]  # scaled on its own, kept by apply -k

    def mode(deployment) -> str:
        env = _container(deployment)["env"]
        values = [e["value"] for e in env if e["name"] == "PAGEDSERVE_DISAGGREGATION_MODE"]
        assert len(values) == 1
        return values[0]

    assert (mode(prefill), mode(decode)) == ("prefill", "decode")
    assert "PAGEDSERVE_DISAGGREGATION_MODE" in FLAG_TYPES  # a real flag's variable

    def normalized(deployment, role: str) -> dict:
        text = json.dumps(deployment, sort_keys=True)
        text = text.replace("pagedserve-executor-decode", "pagedserve-executor")
        text = text.replace(f'"{role}"', '"ROLE"')
        return json.loads(text)

    assert normalized(prefill, "prefill") == normalized(decode, "decode")
    gpu = _one(rendered["gpu"], "Deployment", "pagedserve-executor")
    without_role = normalized(prefill, "prefill")
    for labels in (without_role["metadata"]["labels"],
                   without_role["spec"]["selector"]["matchLabels"],
                   without_role["spec"]["template"]["metadata"]["labels"]):
        del labels[ROLE]
    _container(without_role)["env"] = [e for e in _container(without_role)["env"]
                                       if e["name"] != "PAGEDSERVE_DISAGGREGATION_MODE"]
    assert without_role == gpu
    # both reach the router: its policy admits pods by the executor labels both carry
    for deployment in (prefill, decode):
        assert EXECUTOR_LABELS.items() <= deployment["spec"]["template"]["metadata"][
            "labels"].items()
