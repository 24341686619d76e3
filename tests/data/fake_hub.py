"""A local folder served as the Hugging Face Hub, over HTTP, for huggingface_hub's real client.

The Hub is unreachable here, so the download tests point ``HF_ENDPOINT`` at this
server: the endpoints and headers are the ones huggingface_hub 1.x uses for
``HfApi.*_info``, ``snapshot_download`` (the recursive tree listing) and
``hf_hub_download`` (HEAD for the commit, ETag and size, then GET). Each repo is
one folder and has one commit; ``main`` and that commit resolve, other revisions
answer RevisionNotFound, as the Hub does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


class FakeHub:
    """``repos``: {("dataset" | "model", "org/name"): folder}. Use as a context manager; ``env`` is what
    a client process needs (endpoint, Xet off, online, its own cache)."""

    def __init__(self, repos: dict[tuple[str, str], Path], home: Path):
        self.repos, self.home, self.requests = repos, home, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    @property
    def env(self) -> dict[str, str]:
        return {"HF_ENDPOINT": f"http://127.0.0.1:{self.server.server_port}", "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_OFFLINE": "0", "HF_HOME": str(self.home), "HF_HUB_DISABLE_TELEMETRY": "1"}

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _reply(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for k, v in {"Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _missing(self, code: str, body: bool, commit: str = "") -> None:
                self._reply(404, b"{}", {"X-Error-Code": code, "Content-Type": "application/json",
                                         **({"X-Repo-Commit": commit} if commit else {})}, body)

            def _repo(self, kind: str, parts: list[str]):
                repo_id = "/".join(parts[:2])
                return repo_id, hub.repos.get((kind, repo_id))

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                parts = [p for p in path.split("/") if p]
                if parts[:1] == ["api"]:  # /api/{datasets|models}/org/name[/revision/R | /tree/R[/path]]
                    kind = parts[1].rstrip("s")
                    repo_id, folder = self._repo(kind, parts[2:])
                    if folder is None:
                        return self._missing("RepoNotFound", body)
                    rest = parts[4:]
                    revision = rest[1] if len(rest) > 1 else "main"
                    commit = commit_of(repo_id)
                    if revision not in ("main", commit):
                        return self._missing("RevisionNotFound", body)
                    if rest[:1] == ["tree"]:
                        files = [{"type": "file", "path": str(f.relative_to(folder)), "size": f.stat().st_size,
                                  "oid": hashlib.sha1(f.read_bytes()).hexdigest()}
                                 for f in sorted(folder.rglob("*")) if f.is_file()]
                        data = json.dumps(files).encode()
                    else:
                        data = json.dumps({"id": repo_id, "sha": commit, "private": False, "gated": False,
                                           "siblings": [{"rfilename": str(f.relative_to(folder))}
                                                        for f in sorted(folder.rglob("*")) if f.is_file()]}).encode()
                    return self._reply(200, data, {"Content-Type": "application/json"}, body)
                # /datasets/org/name/resolve/R/file  or  /org/name/resolve/R/file (models)
                kind = "dataset" if parts[:1] == ["datasets"] else "model"
                parts = parts[1:] if kind == "dataset" else parts
                repo_id, folder = self._repo(kind, parts)
                if folder is None or parts[2:3] != ["resolve"]:
                    return self._missing("RepoNotFound", body)
                commit = commit_of(repo_id)
                if parts[3] not in ("main", commit):
                    return self._missing("RevisionNotFound", body)
                file = folder / "/".join(parts[4:])
                if not file.is_file():
                    return self._missing("EntryNotFound", body, commit)
                data = file.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                self._reply(200, data, {"X-Repo-Commit": commit, "ETag": f'"{etag}"',
                                        "Content-Type": "application/octet-stream"}, body)

        return Handler
