"""A fake Hugging Face hub on loopback: a real HTTP server (threads) that serves model repositories from
local folders, answers as the hub does for a missing or gated repository, and records every request."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeHub:
    """Repositories by id: a folder (served) or ``"gated"``; anything else answers RepoNotFound."""

    repos: dict[str, Path | str] = field(default_factory=dict)
    commits: dict[str, str] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    connections: int = 0
    url: str = ""

    def commit(self, repo_id: str) -> str:
        return self.commits.setdefault(repo_id, hashlib.sha1(repo_id.encode()).hexdigest())


def _split_repo(path: str) -> tuple[str, str]:
    """("org/name", rest) from "org/name/rest"."""
    parts = path.split("/", 2)
    return "/".join(parts[:2]), parts[2] if len(parts) > 2 else ""


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def setup(self) -> None:
            hub.connections += 1
            super().setup()

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: object, headers: dict[str, str] | None = None) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _refuse(self, repo_id: str) -> bool:
            repo = hub.repos.get(repo_id)
            if repo == "gated":
                self._send(
                    401,
                    b'{"error": "Access to model is restricted."}',
                    {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted."},
                )
                return True
            if not isinstance(repo, Path):
                self._send(
                    404,
                    b'{"error": "Repository not found"}',
                    {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                )
                return True
            return False

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            path = unquote(urlsplit(self.path).path)
            if path.startswith("/api/models/"):
                repo_id, rest = _split_repo(path.removeprefix("/api/models/"))
                if self._refuse(repo_id):
                    return
                folder = hub.repos[repo_id]
                assert isinstance(folder, Path)
                files = sorted(p for p in folder.rglob("*") if p.is_file())
                if rest.startswith("revision/") or rest == "":
                    siblings = [{"rfilename": p.relative_to(folder).as_posix()} for p in files]
                    self._json({"id": repo_id, "modelId": repo_id, "sha": hub.commit(repo_id), "siblings": siblings})
                    return
                if rest.startswith("tree/"):
                    entries = [
                        {
                            "type": "file",
                            "path": p.relative_to(folder).as_posix(),
                            "size": p.stat().st_size,
                            "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                        }
                        for p in files
                    ]
                    self._json(entries)
                    return
                self._send(404)
                return
            repo_id, rest = _split_repo(path.lstrip("/"))
            if not rest.startswith("resolve/"):
                self._send(404)
                return
            if self._refuse(repo_id):
                return
            folder = hub.repos[repo_id]
            assert isinstance(folder, Path)
            _, _revision, filename = rest.split("/", 2)
            file = folder / filename
            if not file.is_file():
                self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": hub.commit(repo_id)})
                return
            body = file.read_bytes()
            etag = hashlib.sha1(body).hexdigest()
            self._send(200, body, {"X-Repo-Commit": hub.commit(repo_id), "ETag": f'"{etag}"'})

    return Handler


@contextmanager
def fake_hub(repos: dict[str, Path | str] | None = None) -> Iterator[FakeHub]:
    """Run a fake hub on 127.0.0.1 (a free port) for the block; ``hub.url`` is its endpoint."""
    hub = FakeHub(repos=dict(repos or {}))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
