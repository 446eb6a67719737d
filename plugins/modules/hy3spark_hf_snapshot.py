#!/usr/bin/python
"""hy3spark_hf_snapshot: locate or download one model revision into a Hugging Face hub cache (huggingface_hub)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: hy3spark_hf_snapshot
short_description: Locate or download a model snapshot with huggingface_hub's snapshot_download
description:
  - Runs under a Python that has huggingface_hub (the role's venv, via ansible_python_interpreter).
  - A 40-character commit sha whose snapshot is complete in the cache needs no network at all. Otherwise
    snapshot_download fetches what is missing; files already in the cache are kept, and an interrupted file is
    resumed within the call (HTTP Range) by huggingface_hub.
  - The token is a module argument (no_log), so it never appears on a command line, in the environment of another
    process or in a file; it is handed to snapshot_download directly.
  - Reports changed only when files or refs were added.
options:
  repo: {description: org/name on the hub., type: str, required: true}
  revision: {description: "Branch, tag or 40-character commit sha.", type: str, required: true}
  cache_dir: {description: The hub cache (HF_HUB_CACHE)., type: path, required: true}
  token: {description: Hub token; empty for none., type: str, no_log: true, default: ""}
  endpoint: {description: Hub endpoint (HF_ENDPOINT); empty for the Hugging Face Hub., type: str, default: ""}
  max_workers: {description: Files downloaded in parallel., type: int, default: 8}
  owner: {description: User that owns the model's directory afterwards (the one that syncs it)., type: str}
"""

import contextlib
import os
import pwd
import re
import sys

from ansible.module_utils.basic import AnsibleModule

SHA1 = re.compile(r"^[0-9a-f]{40}$")


def tree_state(repo_dir):
    """Every file and link under the model's directory with its size: what a download adds to."""
    state = {}
    for dirpath, _dirnames, filenames in os.walk(repo_dir):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(".incomplete") or name.endswith(".lock"):
                continue
            with contextlib.suppress(OSError):  # removed while we walk: not part of the state
                state[os.path.relpath(full, repo_dir)] = os.lstat(full).st_size
    for ref_dir, _d, names in os.walk(os.path.join(repo_dir, "refs")):
        for name in names:
            with open(os.path.join(ref_dir, name)) as fh:
                state["ref:" + os.path.relpath(os.path.join(ref_dir, name), repo_dir)] = fh.read().strip()
    return state


def chown_tree(path, owner):
    entry = pwd.getpwnam(owner)
    changed = False
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            st = os.lstat(name)
            if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
                os.lchown(name, entry.pw_uid, entry.pw_gid)
                changed = True
    return changed


def main():
    module = AnsibleModule(
        argument_spec={
            "repo": {"type": "str", "required": True},
            "revision": {"type": "str", "required": True},
            "cache_dir": {"type": "path", "required": True},
            "token": {"type": "str", "default": "", "no_log": True},
            "endpoint": {"type": "str", "default": ""},
            "max_workers": {"type": "int", "default": 8},
            "owner": {"type": "str"},
        },
        supports_check_mode=True,
    )
    p = module.params
    # huggingface_hub reads these when it is imported.
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "0"
    os.environ.pop("HF_TOKEN", None)
    if p["endpoint"]:
        os.environ["HF_ENDPOINT"] = p["endpoint"].rstrip("/")
    try:
        import huggingface_hub
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        module.fail_json(msg=f"huggingface_hub is not importable by {sys.executable}: {exc}")

    org, name = p["repo"].split("/", 1)
    repo_dir = os.path.join(p["cache_dir"], f"models--{org}--{name}")
    token = p["token"] or None
    before = tree_state(repo_dir)
    result = {"changed": False, "repo_dir": repo_dir, "huggingface_hub": huggingface_hub.__version__}

    # A pinned commit that is complete locally: no network (and no hub needed: a re-run works offline).
    local = None
    if SHA1.match(p["revision"]) or module.check_mode:
        try:
            local = snapshot_download(p["repo"], revision=p["revision"], cache_dir=p["cache_dir"],
                                      local_files_only=True)
        except Exception:  # any failure means "not complete locally"
            local = None
    if local is not None and SHA1.match(p["revision"]):
        snapshot = local
    elif module.check_mode:
        module.exit_json(msg=f"would download {p['repo']}@{p['revision']} into {p['cache_dir']}",
                         **dict(result, changed=local is None, snapshot=local))
    else:
        try:
            snapshot = snapshot_download(p["repo"], revision=p["revision"], cache_dir=p["cache_dir"], token=token,
                                         max_workers=p["max_workers"])
        except Exception as exc:
            module.fail_json(msg=f"snapshot_download({p['repo']}, revision={p['revision']}) failed: "
                                 f"{type(exc).__name__}: {exc}", **result)
    after = tree_state(repo_dir)
    result["changed"] = after != before
    result["added"] = sorted(k for k in after if k not in before)
    if p["owner"] and not module.check_mode:
        result["changed"] = chown_tree(repo_dir, p["owner"]) or result["changed"]
    result["snapshot"] = snapshot
    result["commit"] = os.path.basename(snapshot.rstrip("/"))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
