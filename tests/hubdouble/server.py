"""The HTTP side of the Hub double: the requests `huggingface_hub` makes, answered the way the real Hub answers.

1. `GET /api/models/{repo}/revision/{rev}` (and `/api/models/{repo}`): JSON with `sha` and `siblings`.
2. `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`: the file list with `oid`, `size` and, for LFS files,
   `lfs: {oid: sha256, size, pointerSize}`.
3. `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: `X-Repo-Commit`, `ETag` (git sha1 of a regular file), and for LFS files
   `X-Linked-Etag` (sha256) + `X-Linked-Size`. LFS files are 302-redirected to `/lfs-cdn/<sha256>` as the Hub sends
   them to its CDN (with `redirect_lfs=False` they are served in place).
   The CDN is a second port (another origin), so the client neither follows it for metadata nor sends the token.
4. `Range: bytes=N-[M]` -> 206 with `Content-Range` (416 past the end): the resume path.
5. Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`) and `X-Error-Message`.

Test knobs: `token` (then the API and resolve URLs need `Authorization: Bearer <token>`; the CDN does not, like the
Hub's signed URLs), `drop_once` (file -> byte count: the first GET of that file is cut after that many body bytes
and the socket closed, the way a dropped connection looks), `rate` (bytes/s per response, to have time to kill a
transfer), `link_rate` (bytes/s shared by every response at once: one internet link, as a real download from
the Hub is bound by the site's uplink, not by the server). Every request is logged (method, path, status, range,
whether auth was valid; never the token).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from hubdouble.repo import FileInfo, RepoIndex, index_repo

_REPO = r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)"
_ROUTES = [
    ("revision", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$")),
    ("tree", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("info", re.compile(rf"^/api/models/{_REPO}$")),
    ("resolve", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("cdn", re.compile(r"^/lfs-cdn/(?P<sha>[0-9a-f]{64})$")),
]
_BLOCK = 256 << 10


class HubDouble:
    """One repo (`repo_id`, served from `root`) at one commit; `start()` runs it on a background thread."""

    def __init__(self, root: str | os.PathLike[str], repo_id: str, *, host: str = "127.0.0.1", port: int = 0,
                 cdn_port: int = 0, token: str | None = None, drop_once: dict[str, int] | None = None,
                 rate: int | None = None, link_rate: int | None = None,
                 redirect_lfs: bool = True, log_path: str | os.PathLike[str] | None = None,
                 aliases: tuple[str, ...] = ("main",)) -> None:
        self.root = Path(root)
        self.repo_id = repo_id
        self.index: RepoIndex = index_repo(self.root)
        self.token = token
        self.drop_once = dict(drop_once or {})
        self.rate = rate
        self.link_rate = link_rate
        self._link_free_at = 0.0  # when the shared link has sent everything queued on it so far
        self.redirect_lfs = redirect_lfs
        self.aliases = aliases
        self.log_path = Path(log_path) if log_path else None
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._by_sha = {f.sha256: f for f in self.index.files.values() if f.sha256}
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self.httpd.daemon_threads = True
        # LFS files are redirected to a second origin, as the Hub sends them to its CDN: the client must not
        # follow that redirect for metadata, and must not send the token there.
        self.cdn = ThreadingHTTPServer((host, cdn_port), _handler_for(self))
        self.cdn.daemon_threads = True
        self._threads: list[threading.Thread] = []

    def pace_link(self, nbytes: int) -> None:
        """Wait for `nbytes` to cross the shared link: each chunk takes its slot after the ones queued before it."""
        if not self.link_rate:
            return
        with self._lock:
            now = time.monotonic()
            self._link_free_at = max(now, self._link_free_at) + nbytes / self.link_rate
            wait = self._link_free_at - now
        time.sleep(wait)

    @property
    def commit(self) -> str:
        return self.index.commit

    @property
    def endpoint(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubDouble:
        for server in (self.httpd, self.cdn):
            thread = threading.Thread(target=server.serve_forever, name="hubdouble", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def serve_forever(self) -> None:
        threading.Thread(target=self.cdn.serve_forever, name="hubdouble-cdn", daemon=True).start()
        self.httpd.serve_forever()

    def stop(self) -> None:
        for server in (self.httpd, self.cdn):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def resolve_rev(self, rev: str) -> str | None:
        rev = unquote(rev)
        return self.commit if rev == self.commit or rev in self.aliases else None

    def log(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)
            if self.log_path:
                with self.log_path.open("a") as fh:
                    fh.write(json.dumps(entry) + "\n")

    def take_drop(self, path: str) -> int | None:
        with self._lock:
            return self.drop_once.pop(path, None)


def _handler_for(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "hubdouble/1"

        def log_message(self, format: str, *args: Any) -> None:  # the base class names it format
            pass  # requests go to hub.log instead of stderr

        def do_HEAD(self) -> None:
            self._dispatch(body=False)

        def do_GET(self) -> None:
            self._dispatch(body=True)

        # -- plumbing ------------------------------------------------------------------------------------------
        def _auth(self) -> str:
            header = self.headers.get("Authorization", "")
            if not header:
                return "none"
            return "valid" if hub.token is not None and header == f"Bearer {hub.token}" else "invalid"

        def _send(self, status: int, headers: dict[str, str], payload: bytes = b"", body: bool = True,
                  entry: dict[str, Any] | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body and payload:
                self.wfile.write(payload)
            hub.log({**(entry or {}), "status": status, "bytes": len(payload) if body else 0})

        def _json(self, status: int, data: Any, body: bool, entry: dict[str, Any]) -> None:
            self._send(status, {"Content-Type": "application/json"}, json.dumps(data).encode(), body, entry)

        def _error(self, status: int, code: str | None, message: str, body: bool, entry: dict[str, Any]) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, headers, json.dumps({"error": message}).encode(), body, entry)

        def _dispatch(self, body: bool) -> None:
            url = urlsplit(self.path)
            entry: dict[str, Any] = {"method": self.command, "path": url.path, "range": self.headers.get("Range"),
                                     "auth": self._auth(), "time": round(time.time(), 3)}
            kind, match = next(((k, m) for k, p in _ROUTES if (m := p.match(url.path))), ("", None))
            if match is None:
                self._error(404, None, "Not Found (the Hub double serves one model repo)", body, entry)
                return
            groups = match.groupdict()
            if kind == "cdn":
                info = hub._by_sha.get(groups["sha"])
                if info is None:
                    self._error(404, None, "No such LFS object", body, entry)
                else:
                    self._file(info, {}, body, entry)
                return
            if hub.token is not None and entry["auth"] != "valid":
                if entry["auth"] == "none":
                    self._error(401, "RepoNotFound", "Repository Not Found: private repo, authenticate", body, entry)
                else:
                    self._error(401, None, "Invalid credentials in Authorization header", body, entry)
                return
            if groups["repo"] != hub.repo_id:
                self._error(404, "RepoNotFound", f"Repository Not Found for {groups['repo']}", body, entry)
                return
            rev = groups.get("rev") or "main"
            commit = hub.resolve_rev(rev)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}", body, entry)
                return
            if kind in ("revision", "info"):
                self._json(200, self._model_info(), body, entry)
            elif kind == "tree":
                self._tree(unquote(groups.get("path") or "").strip("/"), body, entry)
            else:
                self._resolve(unquote(groups["path"]), body, entry)

        # -- endpoints -----------------------------------------------------------------------------------------
        def _model_info(self) -> dict[str, Any]:
            return {"_id": hub.commit[:24], "id": hub.repo_id, "modelId": hub.repo_id,
                    "author": hub.repo_id.split("/")[0],
                    "sha": hub.commit, "private": hub.token is not None, "gated": False, "disabled": False,
                    "downloads": 0, "likes": 0, "tags": ["safetensors"], "library_name": "transformers",
                    "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": p} for p in hub.index.files]}

        def _tree(self, prefix: str, body: bool, entry: dict[str, Any]) -> None:
            recursive = "recursive=true" in (urlsplit(self.path).query or "").lower()
            out: list[dict[str, Any]] = []
            dirs: set[str] = set()
            for path, info in hub.index.files.items():
                if prefix and not path.startswith(prefix + "/"):
                    continue
                rest = path[len(prefix) + 1:] if prefix else path
                if "/" in rest:
                    top = (prefix + "/" if prefix else "") + rest.split("/", 1)[0]
                    if top not in dirs:
                        dirs.add(top)
                        out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": top})
                    if not recursive:
                        continue
                item: dict[str, Any] = {"type": "file", "oid": info.git_oid, "size": info.size, "path": path}
                if info.lfs:
                    item["lfs"] = {"oid": info.sha256, "size": info.size, "pointerSize": 134}
                out.append(item)
            if prefix and not out:
                self._error(404, "EntryNotFound", f"{prefix} does not exist on {hub.commit}", body, entry)
                return
            self._json(200, out, body, entry)

        def _resolve(self, path: str, body: bool, entry: dict[str, Any]) -> None:
            info = hub.index.files.get(path)
            if info is None:
                self._error(404, "EntryNotFound", f"{path} does not exist on {hub.commit}", body, entry)
                return
            headers = {"X-Repo-Commit": hub.commit}
            if info.lfs:
                headers.update({"X-Linked-Etag": f'"{info.sha256}"', "X-Linked-Size": str(info.size)})
                if hub.redirect_lfs:
                    host = (self.headers.get("Host") or str(hub.httpd.server_address[0])).rsplit(":", 1)[0]
                    location = f"http://{host}:{hub.cdn.server_address[1]}/lfs-cdn/{info.sha256}?file={quote(path)}"
                    self._send(302, {**headers, "Location": location, "ETag": f'"{info.git_oid}"'}, b"", body, entry)
                    return
            self._file(info, headers, body, entry)

        def _file(self, info: FileInfo, headers: dict[str, str], body: bool, entry: dict[str, Any]) -> None:
            size = info.size
            start, end, status = 0, size - 1, 200
            wanted = self.headers.get("Range")
            if wanted:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
                if not m or int(m.group(1)) >= size:
                    self._send(416, {**headers, "Content-Range": f"bytes */{size}"}, b"", body, entry)
                    return
                start, status = int(m.group(1)), 206
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            length = end - start + 1
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("ETag", f'"{info.etag}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            sent = 0
            if body:
                cut = hub.take_drop(info.path)
                limit = length if cut is None else min(cut, length)
                began = time.monotonic()
                with (hub.root / info.path).open("rb") as fh:
                    fh.seek(start)
                    while sent < limit:
                        chunk = fh.read(min(_BLOCK, limit - sent))
                        if not chunk:
                            break
                        try:
                            self.wfile.write(chunk)
                        except OSError:  # the client went away (a killed download): nothing left to do
                            break
                        sent += len(chunk)
                        hub.pace_link(len(chunk))
                        if hub.rate:
                            ahead = sent / hub.rate - (time.monotonic() - began)
                            if ahead > 0:
                                time.sleep(ahead)
                if cut is not None and sent < length:
                    entry["dropped_after"] = sent
                    self.close_connection = True
                    try:
                        self.wfile.flush()
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            hub.log({**entry, "status": status, "bytes": sent, "file": info.path})

    return Handler


def serve(root: str, repo_id: str, **kwargs: Any) -> None:
    """Run in the foreground until interrupted (the CLI's `serve`)."""
    hub = HubDouble(root, repo_id, **kwargs)
    print(f"hubdouble: {repo_id}@{hub.commit} from {root} on {hub.endpoint} (LFS via port {hub.cdn.server_address[1]})",
          flush=True)
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
