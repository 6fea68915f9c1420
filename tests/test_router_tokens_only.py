"""An API worker's requests in the engine (`text=False`): their outputs are tokens, and a
token that ends nothing is handed to the sink as `apply_tokens` applies it (the text
stage's cheap form, `push_token`). Against tests/pipeline_rig.py's simulated executor: the
same requests with text and without give the same tokens, endings and usage, and every
token is counted once in pagedserve_generation_tokens_total."""

from __future__ import annotations

from pagedserve.router.sequence import OutputChannel
from pagedserve.router.types import RequestSpec, SamplingSpec
from pipeline_rig import Collector, expected, free_blocks, make_engine, run, settle, sim_token

SPECS = [
    ("a", [1, 2, 3, 4, 5], dict(max_tokens=7)),
    ("b", [6, 7, 8], dict(max_tokens=9, n=2)),
    # a stop id that the simulated executor samples at b's... c's output position 3
    ("c", [9, 10, 11, 12], dict(max_tokens=12, stop_token_ids=(sim_token("c#0", 3),))),
    ("d", [13, 14], dict(max_tokens=5, min_tokens=5, stop_token_ids=(sim_token("d#0", 1),))),
]


class Sink(OutputChannel):
    """An OutputChannel that records which form each token came in."""

    def __init__(self) -> None:
        super().__init__()
        self.pushed = 0

    def push_token(self, index: int, token_id: int) -> None:
        self.pushed += 1
        super().push_token(index, token_id)


def _generation_tokens(engine) -> float:
    return engine.metrics.registry.get_sample_value("pagedserve_generation_tokens_total")


async def _serve(text: bool):
    engine, ex = make_engine(2)
    sinks, streams = {}, {}
    for rid, prompt, sampling in SPECS:
        spec = RequestSpec(rid, tuple(prompt), SamplingSpec(temperature=0.0, **sampling))
        sinks[rid] = Sink()
        engine.admit(spec, channel=sinks[rid], text=text)
        streams[rid] = Collector(sinks[rid].stream(rid))
    engine.executors["e0"].wakeup.set()
    await ex.run_until_done(list(streams.values()))
    while ex.unanswered():
        await ex.answer()
    await settle()
    outputs = {}
    for rid, c in streams.items():
        assert c.error is None
        for index in range(2 if rid == "b" else 1):
            fin = c.finish(index)
            outputs[rid, index] = (c.tokens(index), fin.finish_reason, fin.stop_token_id)
        outputs[rid, "usage"] = c.usage
    counted = _generation_tokens(engine)
    assert free_blocks(engine) == (64, 64) and not engine.live
    return outputs, counted, {rid: s.pushed for rid, s in sinks.items()}


def test_tokens_only_requests_get_what_text_requests_get_and_count_once():
    async def main():
        with_text, counted_text, _ = await _serve(text=True)
        tokens_only, counted, pushed = await _serve(text=False)
        assert tokens_only == with_text
        assert tokens_only["a", 0] == (expected("a#0", 7), "length", None)
        assert tokens_only["b", 1] == (expected("b#1", 9), "length", None)
        stop = sim_token("c#0", 3)
        assert tokens_only["c", 0] == (expected("c#0", 4), "stop", stop)
        assert tokens_only["d", 0] == (expected("d#0", 5), "length", None)  # min_tokens
        total = sum(len(v[0]) for k, v in tokens_only.items() if k[1] != "usage")
        assert total == 7 + 9 + 9 + 4 + 5
        assert counted == counted_text == total
        # all but each sample's last token went as push_token (it ends the sample: the
        # text stage delivers it with its finish)
        assert pushed == {"a": 6, "b": 16, "c": 3, "d": 4}
    run(main())
