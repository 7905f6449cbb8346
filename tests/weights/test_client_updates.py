"""The Python API's weight update: `InProcessGateway.update_weights` (and `GatewayClient`'s, the same
HTTP call) is `POST /admin/weights` with the trainer key, answering the phase timings; a refused
update raises the gateway's error and changes nothing; a caller without the trainer key is refused."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tokentape.client import GatewayClient, InProcessGateway
from tokentape.gateway.service import Gateway
from tokentape.served import Served, ServeSpec

TRAINER = "trainer-key-for-updates"


@pytest.mark.parametrize("spec", [ServeSpec(served_model_name="smollm2", api_keys=(TRAINER,))])
async def test_update_weights_through_the_python_api(
    fresh_served: Served, fresh: Gateway, adapters: list[Path]
) -> None:
    local = InProcessGateway(served=fresh_served)
    try:
        await local.create_session("before")
        before = local.client("before")
        reply = await before.chat.completions.create(
            model=local.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        assert reply.choices[0].message.content is not None
        report = await local.update_weights(1, lora=str(adapters[0]))
        assert set(report["phases"]) >= {"check", "hold", "pause", "load", "probe", "resume"}
        assert all(seconds >= 0 for seconds in report["phases"].values()) and report["paused_seconds"] >= 0
        assert report["status"]["weights_version"] == 1 and fresh.gate.version == 1
        assert fresh.engine.weights_version == 1  # type: ignore[attr-defined]
        await local.create_session("after")
        await local.client("after").chat.completions.create(
            model=local.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        (branch,) = (await local.export("after"))["branches"]
        assert {v for v in branch["versions"] if v >= 0} == {1}
        # a version that is not new: refused before anything paused, nothing changed
        with pytest.raises(openai.APIStatusError) as refused:
            await local.update_weights(1, lora=str(adapters[1]), in_flight="keep")
        assert refused.value.status_code in (400, 409) and "version" in refused.value.message
        with pytest.raises(openai.APIStatusError) as unknown:
            await local.update_weights(2, lora=str(adapters[1]), in_flight="sideways")
        assert unknown.value.status_code == 400
        assert fresh.gate.version == 1 and not fresh.paused
        # engine_managed reaches the gateway, and the embedded engine (which loads its own) refuses it
        with pytest.raises(openai.APIStatusError) as managed:
            await local.update_weights(2, engine_managed=True)
        assert "send a lora or a model path" in managed.value.message and fresh.gate.version == 1
        report = await local.update_weights(2, lora=str(adapters[1]), in_flight="abort")
        assert report["in_flight"] == "abort" and report["status"]["weights_version"] == 2
        # an agent's key (or none) may not update weights
        agent = GatewayClient(local.http, local.model, api_key=local.session_key("after"))
        with pytest.raises(openai.APIStatusError) as forbidden:
            await agent.update_weights(3, lora=str(adapters[2]))
        assert forbidden.value.status_code in (401, 403) and fresh.gate.version == 2
    finally:
        await local.aclose()
