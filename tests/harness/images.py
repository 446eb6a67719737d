"""Build the local Docker images the Molecule scenarios run on, from Debian packages: no registry is reachable.

Each recipe (recipes.py) becomes `hy3spark/<name>:<hash>` through `debootstrap --variant=minbase` and
`docker import`. The hash covers the recipe and the code here that shapes an image (builder_fingerprint), so an
existing tag is reused as is. The tags are written to .cache/images.env as `HY3SPARK_<NAME>_IMAGE=...` lines,
which scripts/test exports for the molecule.yml files.

Run through scripts/build-images (as root: debootstrap, chroot and mount need it).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import inspect
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import EXTERNAL_BUILDERS, RECIPES, Recipe

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
DEFAULT_ENV_FILE = CACHE / "images.env"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
REPOSITORY = "hy3spark"
LABEL = "org.hy3spark.recipe"
# What a chroot step sees: nothing of the host's environment (PIP_*, proxies, LC_ALL=C, ...).
CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}


class BuildError(Exception):
    pass


def builder_fingerprint() -> str:
    """The source of what shapes an image's content; the CLI, locking and the env file don't change images."""
    shaping = (ChrootSession, chroot, build, docker_import)
    return repr((CHROOT_ENV, LABEL)) + "".join(inspect.getsource(part) for part in shaping)


def recipe_hash(recipe: Recipe) -> str:
    digest = hashlib.sha256()
    digest.update(builder_fingerprint().encode())
    digest.update(recipe.fingerprint().encode())
    return digest.hexdigest()[:12]


def image_tag(recipe: Recipe) -> str:
    return f"{REPOSITORY}/{recipe.name}:{recipe_hash(recipe)}"


def env_var(recipe: Recipe) -> str:
    return f"HY3SPARK_{recipe.name.upper().replace('-', '_')}_IMAGE"


def run(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(cmd), check=True, text=True, **kwargs)
    except subprocess.CalledProcessError as err:
        raise BuildError(f"command failed with exit code {err.returncode}: {' '.join(cmd)}") from err


def image_exists(tag: str) -> bool:
    result = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False)
    return result.returncode == 0


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path, deepest first."""
    prefix = str(path.resolve())
    found = []
    with open("/proc/mounts") as mounts:
        for line in mounts:
            point = line.split()[1].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, reverse=True)


def remove_rootfs(rootfs: Path) -> None:
    # Never rm -rf through a leftover bind mount of the host's /proc or /dev.
    for point in mounts_under(rootfs):
        subprocess.run(["umount", "-l", point], check=False)
    if mounts_under(rootfs):
        raise BuildError(f"{rootfs} still has mounts; unmount them by hand")
    if rootfs.exists():
        shutil.rmtree(rootfs)


@dataclass
class ChrootSession:
    rootfs: Path

    def run(self, script: str) -> None:
        run(["chroot", str(self.rootfs), "/bin/sh", "-euc", script], env=CHROOT_ENV)


@contextmanager
def chroot(rootfs: Path) -> Iterator[ChrootSession]:
    """A chroot with /proc mounted, name resolution, and services kept from starting."""
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    resolv = rootfs / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    shutil.copyfile("/etc/resolv.conf", resolv)
    run(["mount", "-t", "proc", "proc", str(rootfs / "proc")])
    try:
        yield ChrootSession(rootfs)
    finally:
        subprocess.run(["umount", "-l", str(rootfs / "proc")], check=False)
        policy.unlink()
        # Docker bind-mounts its own resolv.conf into containers; don't ship the build host's.
        resolv.unlink()
        resolv.touch()


def build(recipe: Recipe, tag: str, mirror: str) -> None:
    workdir = CACHE / "images"
    debs = CACHE / "debootstrap-debs" / recipe.suite
    debs.mkdir(parents=True, exist_ok=True)
    rootfs = workdir / f"rootfs-{recipe.name}"
    remove_rootfs(rootfs)
    rootfs.mkdir(parents=True)
    log = workdir / f"debootstrap-{recipe.name}.log"
    try:
        print(f"{recipe.name}: debootstrap {recipe.suite} ({len(recipe.packages)} packages; log {log})", flush=True)
        with log.open("w") as out:
            try:
                run(
                    [
                        "debootstrap",
                        "--variant=minbase",
                        f"--cache-dir={debs}",
                        f"--include={','.join(recipe.packages)}",
                        recipe.suite,
                        str(rootfs),
                        mirror,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            except BuildError:
                tail = log.read_text().splitlines()[-15:]
                raise BuildError("debootstrap failed; last lines of its log:\n" + "\n".join(tail)) from None
        for path, content in recipe.files.items():
            target = rootfs / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        with chroot(rootfs) as session:
            if recipe.setup:
                session.run(recipe.setup)
            if recipe.hook:
                recipe.hook(session)
        docker_import(rootfs, recipe, tag)
    finally:
        remove_rootfs(rootfs)


def docker_import(rootfs: Path, recipe: Recipe, tag: str) -> None:
    changes = [*recipe.changes, f"LABEL {LABEL}={recipe.name}"]
    cmd = ["docker", "import", *(arg for change in changes for arg in ("--change", change))]
    cmd += ["--message", f"hy3spark test image {recipe.name}", "-", tag]
    tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    imported = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True, check=False)
    tar.stdout.close()
    if tar.wait() != 0 or imported.returncode != 0:
        raise BuildError(f"docker import of {tag} failed: {imported.stderr.strip()}")


def prune(recipe: Recipe, keep: str) -> None:
    """Drop this recipe's older tags; an image still used by a container stays (docker refuses)."""
    listed = run(
        ["docker", "image", "ls", "--filter", f"label={LABEL}={recipe.name}", "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True,
    ).stdout.split()
    for old in listed:
        if old != keep and old.startswith(f"{REPOSITORY}/{recipe.name}:"):
            removed = subprocess.run(["docker", "image", "rm", old], capture_output=True, check=False)
            print(f"{recipe.name}: {'removed' if removed.returncode == 0 else 'kept (in use)'} old image {old}")


def write_env(path: Path, recipes: Sequence[Recipe]) -> None:
    """Set the recipes' lines in the env file; lines that external builders wrote stay."""
    mine = {env_var(r): image_tag(r) for r in recipes}
    kept = []
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line.split("=", 1)[0] not in mine]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in [*(f"{k}={v}" for k, v in mine.items()), *kept]))
    tmp.replace(path)


def run_external(script: Path, env_file: Path, force: bool) -> None:
    cmd = ["bash", str(script), "--env-file", str(env_file), *(["--force"] if force else [])]
    run(cmd, cwd=ROOT)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """One builder at a time per tree: other engineers run the suite in the same checkout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another build-images run (lock {path})", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/build-images",
        description="Build (or reuse) the hy3spark test images and write their tags to an env file.",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="build only this recipe, or the external builder in directory NAME (repeatable)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the tag exists")
    parser.add_argument("--list", action="store_true", help="print recipe names, tags and whether they exist")
    parser.add_argument("--env-file", type=Path, default=DEFAULT_ENV_FILE, help="default: %(default)s")
    parser.add_argument(
        "--mirror",
        default=os.environ.get("HY3SPARK_DEBIAN_MIRROR", DEFAULT_MIRROR),
        help="Debian mirror for debootstrap (env HY3SPARK_DEBIAN_MIRROR; default %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    recipes = [make() for make in RECIPES]
    names = {r.name for r in recipes} | {Path(b).parent.name for b in EXTERNAL_BUILDERS}
    unknown = set(args.only or ()) - names
    if unknown:
        print(f"build-images: unknown recipe(s) {sorted(unknown)}; known: {sorted(names)}", file=sys.stderr)
        return 2
    if args.list:
        for recipe in recipes:
            tag = image_tag(recipe)
            print(f"{recipe.name:10} {tag:32} {'present' if image_exists(tag) else 'missing'}")
        return 0
    if os.geteuid() != 0:
        print("build-images: error: must run as root (debootstrap, chroot, mount)", file=sys.stderr)
        return 1
    selected = [r for r in recipes if not args.only or r.name in args.only]
    try:
        with locked(CACHE / "images.lock"):
            for recipe in selected:
                tag = image_tag(recipe)
                start = time.monotonic()
                if image_exists(tag) and not args.force:
                    print(f"{recipe.name}: reusing {tag}")
                    continue
                build(recipe, tag, args.mirror)
                print(f"{recipe.name}: built {tag} in {time.monotonic() - start:.0f} s", flush=True)
                prune(recipe, keep=tag)
            write_env(args.env_file, recipes)
        # Outside the lock: an external builder takes images.lock itself to write its line.
        for relative in EXTERNAL_BUILDERS:
            script = ROOT / relative
            if args.only and script.parent.name not in args.only:
                continue
            if not script.is_file():
                print(f"{relative}: not found, skipped")
                continue
            start = time.monotonic()
            run_external(script, args.env_file, args.force)
            print(f"{relative}: done in {time.monotonic() - start:.0f} s", flush=True)
    except BuildError as err:
        print(f"build-images: error: {err}", file=sys.stderr)
        return 1
    print(f"build-images: tags written to {args.env_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
