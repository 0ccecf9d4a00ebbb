"""`specpage chat` as a person uses it: a subprocess fed through stdin, in-process on a
tiny model with SmolLM2's tokenizer and chat template."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specpage.models.fetch import ensure_model
from tests.support.checkpoints import tiny_checkpoint
from tests.support.daemon import Daemon

VOCAB = 49152  # SmolLM2's, whose tokenizer the tiny model shares
MAX_TOKENS = 5
CHAT_TIMEOUT_S = 240.0
PROMPT_BLOCK = re.compile(r"--- prompt ---\n(.*?)\n--- end of prompt ---", re.DOTALL)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "model"
    tiny_checkpoint(folder, vocab_size=VOCAB)
    smollm2 = ensure_model("smollm2-135m")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2 / file, folder / file)
    return folder


def chat(model: Path, typed: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specpage", "chat", "--model", str(model), "--max-tokens",
         str(MAX_TOKENS), "--show-prompt", *flags],
        input=typed, capture_output=True, text=True, timeout=CHAT_TIMEOUT_S,
    )


def rendered(model: Path, messages: list[dict[str, str]]) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.decode(ids)


def test_each_turn_sends_the_whole_conversation_and_reset_clears_it(model):
    done = chat(model, "hello there\nwhat did I say?\n/reset\nfresh start\n/exit\n")
    assert done.returncode == 0, done.stderr
    first, second, third = PROMPT_BLOCK.findall(done.stderr)
    assert first == rendered(model, [{"role": "user", "content": "hello there"}])
    # The second prompt is the first turn, the reply as streamed, then the new message:
    # exactly what the chat template renders for those three messages.
    replies = done.stdout.split("> ")[1:3]
    reply = replies[0].removesuffix("\n")
    assert reply, done.stdout
    assert second == rendered(model, [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "what did I say?"},
    ])
    assert second.startswith(first)
    assert third == rendered(model, [{"role": "user", "content": "fresh start"}])
    assert "(conversation cleared)" in done.stderr


def test_end_of_input_leaves_with_status_0_and_a_system_message_opens_each_prompt(model):
    done = chat(model, "hi\n", "--system", "Answer briefly.")
    assert done.returncode == 0, done.stderr
    [prompt] = PROMPT_BLOCK.findall(done.stderr)
    assert prompt == rendered(model, [{"role": "system", "content": "Answer briefly."},
                                      {"role": "user", "content": "hi"}])


def test_with_a_daemon_the_http_front_renders_the_same_conversation(model, tmp_path):
    # The daemon's models are this tiny model (the target) and a one-layer draft, with
    # the same tokenizer; greedy replies are the target's, as in-process.
    models = tmp_path / "models"
    shutil.copytree(model, models / "target")
    tiny_checkpoint(models / "draft", seed=1, num_hidden_layers=1, vocab_size=VOCAB)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model / file, models / "draft" / file)
    daemon = Daemon(tmp_path, http=True)
    try:
        daemon.wait_serving()
        typed = "hello there\nwhat did I say?\n/exit\n"
        remote = chat(model, typed, "--url", daemon.http_url)
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()
    local = chat(model, typed)
    assert remote.returncode == local.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and remote.stdout.count("> ") == 3
    first, second = PROMPT_BLOCK.findall(remote.stderr)  # the messages sent, as JSON
    reply = remote.stdout.split("> ")[1].removesuffix("\n")
    assert json.loads(second) == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "what did I say?"},
    ]
    assert json.loads(first) == [{"role": "user", "content": "hello there"}]
