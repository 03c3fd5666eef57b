"""Models from the Hugging Face Hub: ``blink serve ORG/NAME`` as ``vllm serve`` takes it.

``blink serve`` resolves a Hub id once, before it starts any process, to a folder (or one GGUF file) in the Hub's
own cache, through ``huggingface_hub``; the engine and the services are then given that local path, as for a model
given by path. Only what they read is fetched: ``config.json``, ``generation_config.json``, the tokenizer's files and
the safetensors weights (``model.safetensors``, or the index and the shards it names), or the one GGUF file asked
for (``--gguf-file FILE``, or vLLM's ``ORG/NAME-GGUF:QUANT``). ``huggingface_hub`` reads its own settings from the
environment: ``HF_TOKEN``, ``HF_HOME`` (or ``HF_HUB_CACHE``), ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, and shows its
progress bars while it downloads (``HF_HUB_DISABLE_PROGRESS_BARS=1`` hides them). A path that exists is always a
local model, never a Hub id.

Errors come back as ``HubError``, whose message names the repo and says what to do: a repo that does not exist or
is private, a gated repo, a missing revision or file, a Hub that cannot be reached, an offline cache that lacks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

# What the tokenizer service and the gateway read of a model folder (dpu_tokenizer.loader, .hf_json, .chat): the
# tokenizer's config and chat template, generation_config.json (bos and eos ids), and one tokenizer file, the first
# of these that the repo has (the loader's order): tokenizer.json, a tiktoken rank file, tokenizer.model.
TOKENIZER_META = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja", "chat_template.json")
# The engine's (gpu_engine.models.loader): config.json, then model.safetensors or the index and its shards.
CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MODEL_META = (CONFIG_FILE, WEIGHTS_INDEX, *TOKENIZER_META)  # small: fetched first, to know what else to fetch
QUANT = re.compile(r"[A-Za-z0-9_]+")          # the QUANT of vLLM's ORG/NAME-GGUF:QUANT (Q4_K_M, IQ4_XS, F16)
GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}$")  # a split GGUF's part: NAME-00001-of-00003.gguf


class HubError(Exception):
    """A model that could not be had from the Hub; the message names the repo and what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class HubModel:
    """A model named by its Hub id: ``repo`` (ORG/NAME) and, in vLLM's GGUF form ``ORG/NAME:QUANT``, ``quant``."""

    repo: str
    quant: str | None = None


def hub_model(model: str) -> HubModel | None:
    """The Hub repo that ``--model`` names, or None: a path that exists is local, and so is anything that cannot
    be a Hub id (an absolute or ./ path, more than one slash, characters the Hub does not allow)."""
    if Path(model).exists() or model.startswith(("/", ".", "~")):
        return None
    repo, colon, quant = model.partition(":")
    if repo.count("/") != 1 or (colon and not QUANT.fullmatch(quant)):
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return HubModel(repo, quant or None)


@dataclasses.dataclass(frozen=True, slots=True)
class Where:
    """Where models come from: the revision of the model's repo and the cache folder (None: the Hub's default,
    ``HF_HUB_CACHE`` or ``HF_HOME/hub``)."""

    revision: str | None = None
    cache_dir: str | None = None


def fetch_model(model: HubModel, where: Where = Where(), gguf_file: str | None = None) -> Path:
    """The local path of a Hub model, downloaded into the cache where it is not there yet: the snapshot folder of a
    safetensors repo (config, tokenizer and weights), or the one GGUF file of a GGUF repo (``gguf_file``, or the
    file of ``model.quant``)."""
    if model.quant and gguf_file:
        raise HubError(f"{model.repo}: give the GGUF file either as {model.repo}:{model.quant} or as --gguf-file "
                       f"{gguf_file}, not both")
    _log_fetch(model.repo, where)
    with hub_errors(model.repo, where):
        if gguf_file:
            return _download_file(model.repo, gguf_file, where.revision, where)
        folder = _snapshot(model.repo, where.revision, where, MODEL_META)
        commit = folder.name  # snapshots/<commit>: what the branch or tag named when it was fetched
        files = _repo_files(model.repo, commit, where, folder)
        if model.quant:
            return _download_file(model.repo, gguf_for_quant(model, files), commit, where)
        weights = _weight_files(model.repo, folder, files)
        needed = (CONFIG_FILE, *tokenizer_file(files), *weights)
        folder = _snapshot(model.repo, commit, where, (*MODEL_META, *needed))
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise HubError(f"{model.repo}: the snapshot {folder} lacks {', '.join(missing)}"
                       + (" (HF_HUB_OFFLINE is set: nothing was downloaded)" if _offline() else ""))
    return folder


def fetch_tokenizer(repo: str, where: Where = Where(), revision_flag: str = "--tokenizer-revision") -> Path:
    """The snapshot folder of a Hub repo's tokenizer files alone, at ``where.revision`` (None: the default
    branch): ``--tokenizer ORG/NAME``'s, or a model's own when its weights are not wanted (``blink serve
    --frontend-only``). ``revision_flag`` names the flag the revision came from, for a revision the repo lacks."""
    _log_fetch(repo, where)
    with hub_errors(repo, where, revision_flag):
        folder = _snapshot(repo, where.revision, where, TOKENIZER_META)
        chosen = tokenizer_file(_repo_files(repo, folder.name, where, folder))
        if not chosen:
            raise HubError(f"{repo}: no tokenizer.json, *.tiktoken or tokenizer.model in the repo")
        folder = _snapshot(repo, folder.name, where, (*TOKENIZER_META, *chosen))
    if not (folder / chosen[0]).is_file():
        raise HubError(f"{repo}: the snapshot {folder} lacks {chosen[0]}"
                       + (" (HF_HUB_OFFLINE is set: nothing was downloaded)" if _offline() else ""))
    return folder


def tokenizer_file(files: list[str]) -> tuple[str, ...]:
    """The tokenizer file the loader will read of a repo's ``files`` (``dpu_tokenizer.loader``'s order: tokenizer.json,
    the first tiktoken rank file, tokenizer.model), as a pattern for the download; () when there is none."""
    top = sorted(f for f in files if "/" not in f)
    ranks = [f for f in top if f.endswith(".tiktoken")]
    if "tokenizer.json" in top:
        return ("tokenizer.json",)
    if ranks:
        return (ranks[0],)
    if "tokenizer.model" in top:
        return ("tokenizer.model",)
    return ()


def gguf_for_quant(model: HubModel, files: list[str]) -> str:
    """The one GGUF file of ``files`` that vLLM's ``ORG/NAME:QUANT`` names: its name (without ``.gguf``) is QUANT or
    ends in ``-QUANT``, ``.QUANT`` or ``_QUANT``, in any case. A split file (``-00001-of-00002``) is refused."""
    quant = (model.quant or "").lower()
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    found = []
    for name in ggufs:
        stem = GGUF_SHARD.sub("", Path(name).name[:-len(".gguf")]).lower()
        if stem == quant or stem.endswith((f"-{quant}", f".{quant}", f"_{quant}")):
            found.append(name)
    if len(found) == 1 and not GGUF_SHARD.search(found[0][:-len(".gguf")]):
        return found[0]
    if any(GGUF_SHARD.search(name[:-len(".gguf")]) for name in found):
        raise HubError(f"{model.repo}:{model.quant} is split into {len(found)} GGUF files; Blink loads one file: "
                       "merge them (llama.cpp's gguf-split --merge) and serve the result by path")
    if found:
        raise HubError(f"{model.repo}:{model.quant} matches {len(found)} GGUF files ({', '.join(found)}): name one "
                       "with --gguf-file")
    listed = f"its GGUF files: {', '.join(ggufs)}" if ggufs else "it holds no GGUF file"
    raise HubError(f"{model.repo}: no GGUF file for {model.quant} ({listed})")


# ---------------------------------------------------------------------- huggingface_hub calls
def _snapshot(repo: str, revision: str | None, where: Where, patterns: tuple[str, ...]) -> Path:
    from huggingface_hub import snapshot_download

    # A repo with none of the files asked for (a GGUF repo has no config.json) is no news: its warning is held back.
    with _quiet("huggingface_hub._snapshot_download"):
        return Path(snapshot_download(repo, revision=revision, cache_dir=where.cache_dir,
                                      allow_patterns=list(patterns)))


def _download_file(repo: str, filename: str, revision: str | None, where: Where) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=where.cache_dir))


def _repo_files(repo: str, commit: str, where: Where, folder: Path) -> list[str]:
    """The repo's files at ``commit``: the listing ``snapshot_download`` cached with it, else (a cache built by other
    means, offline) the files the snapshot folder holds."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo, revision=commit, cache_dir=where.cache_dir)]
    except CachedRepoTreeNotFoundError:
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _weight_files(repo: str, folder: Path, files: list[str]) -> tuple[str, ...]:
    """The safetensors files the engine loads: the shards the index names, else ``model.safetensors``."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise HubError(f"{repo}: {WEIGHTS_INDEX} is not a safetensors index: {exc}") from None
        return tuple(sorted(set(shards)))
    if SINGLE_WEIGHTS in files:
        return (SINGLE_WEIGHTS,)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ggufs:
        shown = ", ".join(sorted(ggufs)[:8]) + (", ..." if len(ggufs) > 8 else "")
        raise HubError(f"{repo} holds GGUF files, not safetensors weights: name one with --gguf-file FILE or as "
                       f"{repo}:QUANT (its files: {shown})")
    raise HubError(f"{repo}: no {SINGLE_WEIGHTS} or {WEIGHTS_INDEX} (Blink loads safetensors or GGUF weights)"
                   + (" in the cached snapshot (HF_HUB_OFFLINE is set)" if _offline() else ""))


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache(where: Where) -> str:
    from huggingface_hub import constants

    return where.cache_dir or constants.HF_HUB_CACHE


def _log_fetch(repo: str, where: Where) -> None:
    from huggingface_hub import constants

    from shared.log import get_logger

    get_logger("serve").info("model from the Hugging Face Hub", repo=repo, revision=where.revision or "main",
                             endpoint=constants.ENDPOINT, cache=_cache(where), offline=_offline())


@contextlib.contextmanager
def hub_errors(repo: str, where: Where, revision_flag: str = "--revision") -> Iterator[None]:
    """``huggingface_hub``'s errors as a ``HubError`` that names the repo and what to do (a missing revision: the
    flag ``revision_flag`` that asked for it)."""
    import httpx2
    from huggingface_hub import constants, errors, get_token

    endpoint, cache = constants.ENDPOINT, _cache(where)
    token = get_token() is not None  # HF_TOKEN, else the token file of `hf auth login` (in HF_HOME)
    sent = "a token was sent" if token else "no token was sent"
    try:
        yield
    except errors.GatedRepoError:
        raise HubError(f"{repo} is a gated model: ask for access on {endpoint}/{repo}, then set HF_TOKEN to a token "
                       "of the account that has it ("
                       + ("the token sent has no access" if token else "no token was sent") + ")") from None
    except errors.RevisionNotFoundError:
        revision = where.revision or "main"
        raise HubError(f"{repo} has no revision {revision!r} on {endpoint} ({revision_flag})") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{repo}: no such model on {endpoint}, nor a local path of that name; a private repo needs "
                       f"HF_TOKEN set to a token that can read it ({sent})") from None
    except errors.RemoteEntryNotFoundError as exc:
        name = str(exc.response.url).rsplit("/", 1)[-1] if exc.response is not None else "the file"
        raise HubError(f"{repo} has no file {name} on {endpoint}") from None
    except errors.LocalEntryNotFoundError as exc:
        if _offline():
            raise HubError(f"{repo} is not in the Hub cache at {cache} (or only in part), and HF_HUB_OFFLINE is set: "
                           "fetch it once with the Hub in reach, or unset HF_HUB_OFFLINE") from None
        cause = exc.__cause__ or exc
        raise HubError(f"{repo}: the Hub at {endpoint} cannot be reached ({type(cause).__name__}: "
                       f"{str(cause).splitlines()[0] if str(cause) else ''}) and the cache at {cache} does not hold "
                       "it") from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        detail = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise HubError(f"{repo}: the Hub at {endpoint} answered {status} ({detail}; {sent})") from None
    except OSError as exc:
        raise HubError(f"{repo}: could not be stored in {cache}: {exc}") from None
    except httpx2.HTTPError as exc:  # a proxy refusing, a connection lost mid-file: what the library lets through
        raise HubError(f"{repo}: fetching from {endpoint} failed: {type(exc).__name__}: {exc}") from None
