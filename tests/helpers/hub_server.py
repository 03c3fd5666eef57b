"""A local stand-in for the Hugging Face Hub's file API, on a real socket, for ``huggingface_hub`` pointed at it
with ``HF_ENDPOINT``; and the Hub cache's own layout, built on disk, for offline runs.

What ``huggingface_hub`` (2.4) asks of a model repo to download files, and what this answers as the Hub does:

- ``GET /api/models/ORG/NAME/revision/REV``: the repo's info, whose ``sha`` is the commit REV names.
- ``GET /api/models/ORG/NAME/tree/REV?recursive=...``: its files (``oid`` the git blob id, ``size``, and ``lfs`` with
  the sha256 for large files), one page.
- ``HEAD`` and ``GET /ORG/NAME/resolve/REV/PATH``: a file, with ``X-Repo-Commit``, its ``ETag`` (the git blob id, or
  for an LFS file the sha256, also in ``X-Linked-Etag`` with ``X-Linked-Size``) and ``Content-Length``.

Refusals carry the Hub's ``X-Error-Code``: ``RepoNotFound`` (401, also for a private repo without its token),
``GatedRepo`` (401 without a token, 403 with one, on the files of a gated repo), ``RevisionNotFound`` and
``EntryNotFound`` (404). Every request is recorded (``requests``), so a test can see what was fetched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model")
CHUNK = 1 << 20


@dataclasses.dataclass
class HubFile:
    """A file of a repo: its bytes, or a file on disk (read as it is sent)."""

    data: bytes | Path

    def read(self) -> bytes:
        return self.data if isinstance(self.data, bytes) else self.data.read_bytes()

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.stat().st_size

    def chunks(self) -> Iterator[bytes]:
        if isinstance(self.data, bytes):
            yield self.data
            return
        with self.data.open("rb") as fh:
            while block := fh.read(CHUNK):
                yield block


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass
class HubRepo:
    """A model repo: its files at one commit, the refs that name it, and who may read it."""

    repo_id: str
    files: dict[str, HubFile]
    commit: str = dataclasses.field(default_factory=lambda: os.urandom(20).hex())
    refs: tuple[str, ...] = ("main",)
    gated: bool = False           # files refused without a token that has access (granted: ``tokens``)
    tokens: tuple[str, ...] = ()  # private or gated: the tokens that may read it
    _digests: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict, repr=False)

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def digests(self, path: str) -> tuple[str, str]:
        """(git blob id, sha256) of a file, computed once."""
        if path not in self._digests:
            data = self.files[path].read()
            self._digests[path] = git_blob_id(data), hashlib.sha256(data).hexdigest()
        return self._digests[path]

    def etag(self, path: str) -> str:
        blob, sha256 = self.digests(path)
        return sha256 if self.is_lfs(path) else blob

    def tree(self) -> list[dict]:
        entries: list[dict] = []
        folders = sorted({str(Path(p).parent) for p in self.files} - {"."})
        for folder in folders:
            entries.append({"type": "directory", "oid": git_blob_id(folder.encode()), "size": 0, "path": folder})
        for path in sorted(self.files):
            blob, sha256 = self.digests(path)
            entry = {"type": "file", "oid": blob, "size": self.files[path].size, "path": path}
            if self.is_lfs(path):
                entry["lfs"] = {"oid": sha256, "size": self.files[path].size, "pointerSize": 134}
            entries.append(entry)
        return entries


class FakeHub:
    """The repos, served at ``endpoint`` from a thread until ``close``."""

    def __init__(self, repos: list[HubRepo]) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.hub = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def fetched(self, repo_id: str) -> set[str]:
        """The files of a repo that were downloaded (GET on resolve)."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return {unquote(p[len(prefix):]).split("/", 1)[1] for m, p in self.requests
                    if m == "GET" and p.startswith(prefix)}

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet: the hub records its requests itself
        pass

    @property
    def hub(self) -> FakeHub:
        return self.server.hub  # type: ignore[attr-defined,no-any-return]

    def do_GET(self) -> None:
        self.answer(body=True)

    def do_HEAD(self) -> None:
        self.answer(body=False)

    # ------------------------------------------------------------------ routes
    def answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.record(self.command, path)
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, what, rev = "/".join(parts[2:4]), parts[4], parts[5]
            self.api(repo, what, rev, body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        else:
            self.error(404, None, "Not Found", body)

    def readable(self, repo_id: str, body: bool) -> HubRepo | None:
        """The repo, or None once refused as the Hub refuses an unknown or private repo."""
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.tokens and not repo.gated and self.token() not in repo.tokens):
            self.error(401, "RepoNotFound", "Repository not found", body)
            return None
        return repo

    def commit_of(self, repo: HubRepo, rev: str, body: bool) -> str | None:
        if rev in repo.refs or rev == repo.commit:
            return repo.commit
        self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        return None

    def api(self, repo_id: str, what: str, rev: str, body: bool) -> None:
        repo = self.readable(repo_id, body)
        if repo is None or (commit := self.commit_of(repo, rev, body)) is None:
            return
        if what == "revision":
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": bool(repo.tokens and not repo.gated),
                    "gated": "manual" if repo.gated else False, "siblings": [{"rfilename": p} for p in repo.files]}
            self.json(info, body)
        else:
            self.json(repo.tree(), body)

    def resolve(self, repo_id: str, rev: str, file: str, body: bool) -> None:
        repo = self.readable(repo_id, body)
        if repo is None or (commit := self.commit_of(repo, rev, body)) is None:
            return
        if repo.gated and self.token() not in repo.tokens:
            self.error(403 if self.token() else 401, "GatedRepo", f"Access to model {repo_id} is restricted and you "
                       "are not in the authorized list. Visit its page to ask for access.", body)
            return
        if file not in repo.files:
            self.error(404, "EntryNotFound", f"{file} does not exist on \"{rev}\"", body, {"X-Repo-Commit": commit})
            return
        entry, etag = repo.files[file], repo.etag(file)
        self.send_response(200)
        headers = {"Content-Length": str(entry.size), "Content-Type": "application/octet-stream",
                   "X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if repo.is_lfs(file):
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(entry.size)})
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            for block in entry.chunks():
                self.wfile.write(block)

    # ------------------------------------------------------------------ answers
    def token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return None
        return auth.removeprefix("Bearer ").strip() or None

    def json(self, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def error(self, status: int, code: str | None, message: str, body: bool,
              extra: dict[str, str] | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def build_cache(hub_cache: Path, repo: HubRepo, files: list[str] | None = None) -> Path:
    """The Hub cache's layout for ``repo`` as ``huggingface_hub`` keeps it (``models--ORG--NAME/blobs/ETAG``,
    ``snapshots/COMMIT/PATH`` linking to its blob, ``refs/REF`` holding the commit), with ``files`` (default: all)
    in it; returns the snapshot folder."""
    root = hub_cache / ("models--" + repo.repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / repo.commit
    for path in files if files is not None else list(repo.files):
        blob, data = root / "blobs" / repo.etag(path), repo.files[path].data
        blob.parent.mkdir(parents=True, exist_ok=True)
        if blob.exists():
            pass
        elif isinstance(data, Path):  # a large file on disk (the embedded GGUF): its blob links to it, not a copy
            blob.symlink_to(data.resolve())
        else:
            blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in repo.refs:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(repo.commit)
    return snapshot
