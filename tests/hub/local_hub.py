"""A Hugging Face Hub stand-in on 127.0.0.1 for the hub tests: the subset ``huggingface_hub`` 2.4 speaks when it
creates a repo, commits files through LFS (basic and multipart), lists a tree and downloads
(../shared/reference/HUB.md).

State lives in memory: repos with branches and commits (each commit a full ``{path: file}`` map), and one LFS object
store. Every request is recorded (method, path, Host header, Authorization), and ``inject`` makes chosen requests
fail (500 with ``Retry-After: 0``, so the client's retries sleep 1 s instead of up to 8 s).

Routes (``{id}`` is ``namespace/name``, model repos only):

| request | reply |
|---|---|
| ``GET /api/whoami-v2`` | the user, 401 without the token |
| ``GET /api/agent-harnesses`` | an empty registry |
| ``POST /api/repos/create`` | 200 ``{url}``; 409 ``{error, url}`` when it exists; a new repo has one commit (``.gitattributes``) |
| ``POST /api/validate-yaml`` | 200 ``{errors: [], warnings: []}``, 400 with ``errors`` for bad card metadata |
| ``GET /api/models/{id}[/revision/{rev}]`` | ``{id, sha, private, siblings}`` |
| ``POST /api/models/{id}/branch/{b}`` | a branch at main's head (or ``startingPoint``); 409 when it exists |
| ``POST /api/models/{id}/preupload/{rev}`` | ``lfs`` for weight extensions, binary samples and files ≥ 10 MiB; the current ``oid`` per path |
| ``POST /api/models/{id}/commit/{rev}`` | ndjson in, ``{commitOid, commitUrl}`` out; ``lfsFile`` lines must name stored objects |
| ``GET /api/models/{id}/tree/{rev}[/{path}]`` | the files (with ``lfs`` for LFS ones) |
| ``POST /{id}.git/info/lfs/objects/batch`` | no ``actions`` for stored objects; basic PUT below ``multipart_threshold``, else ``chunk_size`` parts |
| ``PUT /storage/{oid}``, ``PUT /storage/{oid}/part/{n}``, ``POST /storage/{oid}/complete`` | the transfers (no auth, like pre-signed URLs); bytes and SHA-256 checked |
| ``POST /{id}.git/info/lfs/objects/verify`` | 200 when stored with that size |
| ``HEAD``/``GET /{id}/resolve/{rev}/{path}`` | the bytes, with ``X-Repo-Commit``, ``ETag`` (git sha1, or sha256 for LFS), ``X-Linked-Size`` |
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

USER = "test-user"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx", ".zip")
LFS_SIZE = 10 * 2**20  # the Hub stores files from 10 MiB up in LFS whatever their name
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
PIPELINE_TAGS = {"text-generation", "text2text-generation", "feature-extraction", "fill-mask"}


def git_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the Hub calls a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


@dataclass
class Entry:
    """One file of a commit: regular bytes, or a reference into the LFS store."""

    size: int
    oid: str  # git sha1 of the bytes (regular) or of the pointer (lfs)
    sha256: str | None = None  # set for LFS files
    data: bytes | None = None  # set for regular files


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, Entry]


@dataclass
class Repo:
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    host: str
    authorization: str | None


@dataclass
class Fault:
    method: str
    path_contains: str
    status: int
    times: int


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **body):
        super().__init__(message)
        self.status, self.code, self.body = status, code, {"error": message, **body}


class LocalHub:
    """The server; ``with LocalHub(token) as hub:`` serves on ``hub.endpoint`` from a background thread."""

    def __init__(self, token: str, multipart_threshold: int = 10 * 2**20, chunk_size: int = 4 * 2**20):
        self.token, self.multipart_threshold, self.chunk_size = token, multipart_threshold, chunk_size
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.parts: dict[tuple[str, int], bytes] = {}
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.errors: list[str] = []  # tracebacks of requests this server failed to handle
        self.lock = threading.RLock()
        self._counter = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LocalHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- test helpers -------------------------------------------------------------------------------------------

    def inject(self, method: str, path_contains: str, status: int = 500, times: int = 1) -> None:
        """Answer the next ``times`` requests whose path contains ``path_contains`` with ``status``."""
        with self.lock:
            self.faults.append(Fault(method, path_contains, status, times))

    def head(self, repo_id: str, branch: str = "main") -> str:
        return self.repos[repo_id].branches[branch]

    def history(self, repo_id: str, branch: str = "main") -> list[Commit]:
        """Commits reachable from ``branch``, newest first."""
        repo, out, oid = self.repos[repo_id], [], self.repos[repo_id].branches[branch]
        while oid is not None:
            out.append(repo.commits[oid])
            oid = repo.commits[oid].parent
        return out

    def read(self, repo_id: str, path: str, branch: str = "main") -> bytes:
        entry = self.repos[repo_id].commits[self.head(repo_id, branch)].files[path]
        return entry.data if entry.sha256 is None else self.lfs[entry.sha256]

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return {path: self.read(repo_id, path, branch) for path in
                self.repos[repo_id].commits[self.head(repo_id, branch)].files}

    def create(self, repo_id: str, files: dict[str, bytes] | None = None) -> None:
        """A repo made outside the client (an existing repo), optionally with a second commit of ``files``."""
        with self.lock:
            self._create_repo(repo_id, private=False)
            if files:
                entries = {path: Entry(len(data), git_sha1(data), data=data) for path, data in files.items()}
                self._commit(repo_id, "main", "existing files", entries, [])

    # ---- state changes ------------------------------------------------------------------------------------------

    def _new_oid(self, *parts) -> str:
        self._counter += 1
        return hashlib.sha1(json.dumps([self._counter, *map(str, parts)]).encode()).hexdigest()

    def _create_repo(self, repo_id: str, private: bool) -> None:
        repo = self.repos[repo_id] = Repo(private)
        oid = self._new_oid(repo_id)
        repo.commits[oid] = Commit(oid, None, "initial commit",
                                   {".gitattributes": Entry(len(GITATTRIBUTES), git_sha1(GITATTRIBUTES),
                                                            data=GITATTRIBUTES)})
        repo.branches["main"] = oid

    def _commit(self, repo_id: str, branch: str, message: str, added: dict[str, Entry], deleted: list[str]) -> str:
        repo = self.repos[repo_id]
        parent = repo.branches[branch]
        files = dict(repo.commits[parent].files)
        for path in deleted:
            for name in [p for p in files if p == path or p.startswith(path.rstrip("/") + "/")]:
                del files[name]
        files.update(added)
        oid = self._new_oid(parent, message, sorted(files))
        repo.commits[oid] = Commit(oid, parent, message, files)
        repo.branches[branch] = oid
        return oid

    # ---- request handling ---------------------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers, body: bytes) -> tuple[int, dict, bytes]:
        """(status, headers, body) for one request."""
        path = urlsplit(raw_path).path  # the query (recursive, expand) changes nothing here
        with self.lock:
            self.requests.append(Request(method, raw_path, headers.get("Host", ""), headers.get("Authorization")))
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path_contains in raw_path:
                    fault.times -= 1
                    return _json(fault.status, {"error": f"injected fault ({fault.status})"}, {"Retry-After": "0"})
        try:
            for route_method, pattern, handler in self._routes():
                match = re.fullmatch(pattern, path)
                if match and route_method == method:
                    args = [None if group is None else unquote(group) for group in match.groups()]
                    return handler(*args, headers=headers, body=body)
            raise HubError(404, f"no route for {method} {path}")
        except HubError as err:
            extra = {"X-Error-Message": str(err)} | ({"X-Error-Code": err.code} if err.code else {})
            status, out_headers, out = _json(err.status, err.body, extra)
            return status, out_headers, b"" if method == "HEAD" else out
        except Exception:  # a bug of this server: recorded for the tests to fail on, answered without retries
            self.errors.append(traceback.format_exc())
            return _json(400, {"error": "local hub bug, see LocalHub.errors"})

    def _routes(self):
        repo = r"/api/models/([^/]+/[^/]+)"
        return [
            ("GET", r"/api/whoami-v2", self._whoami),
            ("GET", r"/api/agent-harnesses", lambda **_: _json(200, {"standardEnvVars": [], "harnesses": {}})),
            ("POST", r"/api/repos/create", self._repos_create),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("GET", repo, lambda repo_id, **kw: self._repo_info(repo_id, "main", **kw)),
            ("GET", repo + r"/revision/([^/]+)", self._repo_info),
            ("POST", repo + r"/branch/([^/]+)", self._create_branch),
            ("POST", repo + r"/preupload/([^/]+)", self._preupload),
            ("POST", repo + r"/commit/([^/]+)", self._commit_route),
            ("GET", repo + r"/tree/([^/]+)(?:/(.*))?", self._tree),
            ("POST", r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", self._lfs_batch),
            ("POST", r"/([^/]+/[^/]+)\.git/info/lfs/objects/verify", self._lfs_verify),
            ("PUT", r"/storage/([0-9a-f]{64})", self._put_object),
            ("PUT", r"/storage/([0-9a-f]{64})/part/(\d+)", self._put_part),
            ("POST", r"/storage/([0-9a-f]{64})/complete", self._complete),
            ("HEAD", r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self._resolve),
            ("GET", r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self._resolve),
        ]

    def _authorize(self, headers) -> None:
        if headers.get("Authorization") != f"Bearer {self.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str, headers, write: bool = False) -> Repo:
        if write or (repo_id in self.repos and self.repos[repo_id].private):
            self._authorize(headers)
        if repo_id not in self.repos:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return self.repos[repo_id]

    def _revision(self, repo: Repo, rev: str) -> Commit:
        oid = repo.branches.get(rev, rev)
        if oid not in repo.commits:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[oid]

    def _whoami(self, *, headers, **_):
        self._authorize(headers)
        return _json(200, {"type": "user", "name": USER, "auth": {"type": "access_token",
                                                                  "accessToken": {"role": "write"}}})

    def _repos_create(self, *, headers, body, **_):
        self._authorize(headers)
        request = json.loads(body)
        repo_id = f"{request.get('organization') or USER}/{request['name']}"
        url = f"{self.endpoint}/{repo_id}"
        with self.lock:
            if repo_id in self.repos:
                return _json(409, {"error": "You already created this model repo", "url": url})
            self._create_repo(repo_id, private=request.get("private", False) or request.get("visibility") == "private")
        return _json(200, {"url": url, "name": repo_id})

    def _validate_yaml(self, *, headers, body, **_):
        self._authorize(headers)
        errors = _card_errors(json.loads(body)["content"])
        return _json(400 if errors else 200, {"errors": [{"message": m} for m in errors], "warnings": []})

    def _repo_info(self, repo_id, rev, *, headers, **_):
        repo = self._repo(repo_id, headers)
        commit = self._revision(repo, rev)
        siblings = [{"rfilename": path} for path in sorted(commit.files)]
        return _json(200, {"id": repo_id, "sha": commit.oid, "private": repo.private, "siblings": siblings})

    def _create_branch(self, repo_id, branch, *, headers, body, **_):
        repo = self._repo(repo_id, headers, write=True)
        with self.lock:
            if branch in repo.branches:
                raise HubError(409, f"Branch {branch} already exists")
            start = (json.loads(body) if body else {}).get("startingPoint") or "main"
            repo.branches[branch] = self._revision(repo, start).oid
        return _json(200, {})

    def _preupload(self, repo_id, rev, *, headers, body, **_):
        repo = self._repo(repo_id, headers, write=True)
        current = self._revision(repo, rev).files
        out = []
        for f in json.loads(body)["files"]:
            binary = b"\0" in base64.b64decode(f["sample"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_SIZE or binary
            existing = current.get(f["path"])
            oid = None if existing is None else existing.sha256 or existing.oid
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        return _json(200, {"files": out})

    def _lfs_batch(self, repo_id, *, headers, body, **_):
        self._repo(repo_id, headers, write=True)
        objects = []
        for obj in json.loads(body)["objects"]:
            oid, size = obj["oid"], obj["size"]
            if oid in self.lfs:
                objects.append({"oid": oid, "size": size})  # stored: no transfer
                continue
            verify = {"href": f"{self.endpoint}/{repo_id}.git/info/lfs/objects/verify"}
            if size > self.multipart_threshold:
                count = -(-size // self.chunk_size)
                header = {"chunk_size": str(self.chunk_size)}
                header |= {f"{n:05d}": f"{self.endpoint}/storage/{oid}/part/{n}" for n in range(1, count + 1)}
                upload = {"href": f"{self.endpoint}/storage/{oid}/complete", "header": header}
            else:
                upload = {"href": f"{self.endpoint}/storage/{oid}"}
            objects.append({"oid": oid, "size": size, "authenticated": True,
                            "actions": {"upload": upload, "verify": verify}})
        return _json(200, {"transfer": "basic", "objects": objects})

    def _put_object(self, oid, *, body, **_):
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"uploaded bytes do not hash to {oid}")
        with self.lock:
            self.lfs[oid] = body
        return 200, {}, b""

    def _put_part(self, oid, number, *, body, **_):
        with self.lock:
            self.parts[(oid, int(number))] = body
        return 200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'}, b""

    def _complete(self, oid, *, body, **_):
        request = json.loads(body)
        with self.lock:
            chunks = []
            for part in sorted(request["parts"], key=lambda p: p["partNumber"]):
                data = self.parts.get((oid, part["partNumber"]))
                if data is None or part["etag"] != f'"{hashlib.md5(data).hexdigest()}"':
                    raise HubError(400, f"part {part['partNumber']} of {oid} missing or with another ETag")
                chunks.append(data)
            data = b"".join(chunks)
            if hashlib.sha256(data).hexdigest() != oid:
                raise HubError(400, f"the parts of {oid} do not hash to it")
            self.lfs[oid] = data
            for part in request["parts"]:
                self.parts.pop((oid, part["partNumber"]), None)
        return _json(200, {})

    def _lfs_verify(self, repo_id, *, headers, body, **_):
        self._repo(repo_id, headers, write=True)
        request = json.loads(body)
        if request["oid"] not in self.lfs or len(self.lfs[request["oid"]]) != request["size"]:
            raise HubError(404, f"object {request['oid']} is not stored")
        return _json(200, {})

    def _commit_route(self, repo_id, rev, *, headers, body, **_):
        repo = self._repo(repo_id, headers, write=True)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise HubError(400, "the first ndjson line must be the header")
        added, deleted = {}, []
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                data = base64.b64decode(value["content"])
                added[value["path"]] = Entry(len(data), git_sha1(data), data=data)
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    raise HubError(400, f"LFS object {value['oid']} of {value['path']} was never uploaded")
                added[value["path"]] = Entry(value["size"], git_sha1(lfs_pointer(value["oid"], value["size"])),
                                             sha256=value["oid"])
            elif line["key"] in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
        with self.lock:
            self._revision(repo, rev)
            if rev not in repo.branches:
                raise HubError(400, f"{rev} is not a branch")
            oid = self._commit(repo_id, rev, lines[0]["value"]["summary"], added, deleted)
        return _json(200, {"commitOid": oid, "commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}",
                           "pullRequestUrl": None})

    def _tree(self, repo_id, rev, prefix, *, headers, **_):
        commit = self._revision(self._repo(repo_id, headers), rev)
        out = []
        for path, entry in sorted(commit.files.items()):
            if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                continue
            item = {"type": "file", "path": path, "size": entry.size, "oid": entry.oid}
            if entry.sha256:
                item["lfs"] = {"oid": entry.sha256, "size": entry.size,
                               "pointerSize": len(lfs_pointer(entry.sha256, entry.size))}
            out.append(item)
        return _json(200, out)

    def _resolve(self, repo_id, rev, path, *, headers, **_):
        commit = self._revision(self._repo(repo_id, headers), rev)
        if path not in commit.files:
            raise HubError(404, f"Entry {path} not found", "EntryNotFound")
        entry = commit.files[path]
        data = entry.data if entry.sha256 is None else self.lfs[entry.sha256]
        out = {"X-Repo-Commit": commit.oid, "ETag": f'"{entry.oid}"', "Content-Length": str(len(data))}
        if entry.sha256:
            out |= {"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)}
        return 200, out, data


def _card_errors(content: str) -> list[str]:
    """What the Hub's metadata check would refuse in a README's YAML front matter."""
    if not content.startswith("---\n"):
        return []
    end = content.find("\n---", 4)
    if end < 0:
        return ["the YAML front matter is not closed by ---"]
    try:
        meta = yaml.safe_load(content[4:end])
    except yaml.YAMLError as err:
        return [f"invalid YAML: {err}"]
    if not isinstance(meta, dict):
        return ["the metadata must be a mapping"]
    errors = []
    if "tags" in meta and not (isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])):
        errors.append('"tags" must be a list of strings')
    bases = meta.get("base_model", [])
    for base in [bases] if isinstance(bases, str) else bases:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(base)):
            errors.append(f'"base_model" is not a valid model id: {base}')
    if "pipeline_tag" in meta and meta["pipeline_tag"] not in PIPELINE_TAGS:
        errors.append(f'"pipeline_tag" must be a known task, got {meta["pipeline_tag"]}')
    if "library_name" in meta and not isinstance(meta["library_name"], str):
        errors.append('"library_name" must be a string')
    return errors


def _json(status: int, payload, headers: dict | None = None) -> tuple[int, dict, bytes]:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode()


def _handler(hub: LocalHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = b""
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, headers, out = hub.handle(self.command, self.path, self.headers, body)
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(out)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_HEAD = _serve

        def log_message(self, *args):
            pass

    return Handler

