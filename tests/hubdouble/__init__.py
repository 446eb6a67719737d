"""A TEST DOUBLE of the Hugging Face Hub: a small stdlib HTTP server that serves one directory as one model repo.

It is not the Hub and does not try to be: it answers the handful of requests that `huggingface_hub`'s
`snapshot_download` / `hf_hub_download` make (revision API, tree API, HEAD/GET on `resolve/`, Range resume) the way
the real Hub does, so the real client code runs against it with `HF_ENDPOINT` pointing here. Nothing in
`huggingface_hub` is mocked. Only the standard library is used, so it also runs inside a bare test node.

- `hubdouble.repo`: generate a small deterministic synthetic model repo and compute its hub metadata.
- `hubdouble.server`: serve it (optionally with a token, a one-time dropped connection, a bandwidth cap).
- `python -m hubdouble generate|serve|manifest`: the same from a shell (see README.md).
"""

from hubdouble.repo import FileInfo, RepoIndex, generate, index_repo
from hubdouble.server import HubDouble, serve

__all__ = ["FileInfo", "HubDouble", "RepoIndex", "generate", "index_repo", "serve"]
