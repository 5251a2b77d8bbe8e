"""Versioned deploys of a policy for vLLM: immutable version directories and atomically flipped links.

    deploy("out/run/policies/hgb", "deploy/root")            # root/versions/<version>, root/current -> it
    deploy(artifact, "deploy/root", candidate=True, fraction=0.1)   # root/candidate -> it: on trial (canary)
    promote("deploy/root"); rollback("deploy/root")

A version is a complete vLLM export (``export_vllm``: ``policy/``, ``speculative_config.json``, ``vllm.env``) plus
``deploy.json`` (its id, the artifact digest, the target, the server's k cap). Its id is the UTC time and the head of
the artifact's digest (``reload.artifact_digest``); it is built in a temporary sibling and renamed into place, and
never written again. ``current`` and ``candidate`` are relative symlinks, replaced atomically (a new link under a
temporary name, then ``os.replace``), so a reader sees the old version or the new one. ``vllm.env`` names the deploy
root, so a server started from any version follows ``current`` (``reload.PolicySlot``: hot reload and canary).

Every version of a root serves one target and fits one k cap (vLLM's ``num_speculative_tokens``, fixed when the
server starts: the first version's ``k_max``); a deploy that breaks either is refused, naming the fix. ``history.json``
records the flips of ``current``; ``rollback`` walks it back one deploy at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from sacpolicy.export.reload import (
    CANARY_FILE,
    CANDIDATE,
    CURRENT,
    VERSIONS,
    artifact_digest,
    is_deploy_root,
    read_link,
)
from sacpolicy.export.vllm import DRAFTER_ENV, POLICY_ENV, export_vllm
from sacpolicy.io import write_json, write_text
from sacpolicy.runtime.artifact import ArtifactError, PolicyArtifact, load_artifact

DEPLOY_FILE, HISTORY_FILE = "deploy.json", "history.json"
_STACK_ACTIONS = ("deploy", "promote", "rollback")  # the flips of `current` (a candidate is not one)


def _source(source, drafter: str | None) -> tuple[PolicyArtifact, str | None]:
    """The artifact of ``source`` (an artifact, its directory, or a ``scripts/export.py format=vllm`` export) and the
    drafter to serve (an export's own unless ``drafter`` names one)."""
    if isinstance(source, PolicyArtifact):
        return source, drafter
    source = Path(source)
    if (source / "vllm.env").is_file() and (source / "policy").is_dir():
        return load_artifact(source / "policy"), drafter or _env(source).get(DRAFTER_ENV) or None
    return load_artifact(source), drafter


def version_info(root, version: str) -> dict:
    path = Path(root) / VERSIONS / version / DEPLOY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path} is missing or unreadable ({e}): {path.parent} is not a complete version; deploy "
                            "the policy again (python scripts/deploy.py --root ... --policy <artifact>)") from e


def current_version(root, name: str = CURRENT) -> str | None:
    link = read_link(root, name)
    return None if link is None else Path(link).name


def write_version(source, root, *, drafter: str | None = None) -> Path:
    """``root/versions/<id>``: the vLLM export of ``source``, checked against the version ``current`` serves (same
    target, ``k_max`` within the root's k cap); never overwrites a version."""
    art, drafter = _source(source, drafter)
    root = Path(root)
    target = (art.provenance or {}).get("target")
    k_cap = art.rule.k_max
    live, info = _reference(root)
    if info is not None:
        k_cap = int(info["k_cap"])
        if info.get("target") != target:
            raise ArtifactError(f"{art.path} was fitted for target {target!r}, but {root} serves "
                                f"{info.get('target')!r} (version {live}); deploy it to a deploy root of its own")
        if art.rule.k_max > k_cap:
            raise ArtifactError(f"{art.path} has k_max {art.rule.k_max}, above the k cap {k_cap} of {root} (the "
                                "servers verify that many draft tokens a step); refit it with k_max <= "
                                f"{k_cap}, or deploy it to a new root and restart the servers from it")
    digest = artifact_digest(art)
    now = time.time()
    version = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1e6) % 1_000_000:06d}Z-{digest[:12]}"
    final = root / VERSIONS / version
    if final.exists():
        raise ArtifactError(f"{final} exists; versions are never overwritten: deploy again")
    tmp = final.with_name(f".{version}.tmp{os.getpid()}")
    try:
        export_vllm(art, tmp, drafter=drafter)
        config = json.loads((tmp / "speculative_config.json").read_text())
        if config.get("method") == "custom_class":  # the learned rule: the server's cap, whichever version starts it
            write_json(tmp / "speculative_config.json", config | {"num_speculative_tokens": k_cap})
        load_artifact(tmp / "policy")  # the copy verifies, checksums included
        env = {POLICY_ENV: root.resolve(), DRAFTER_ENV: _env(tmp).get(DRAFTER_ENV, "")}  # the proposer follows root
        write_text(tmp / "vllm.env", "".join(f"{k}={v}\n" for k, v in env.items()))
        write_json(tmp / DEPLOY_FILE, {"version": version, "digest": digest, "target": target, "k_cap": k_cap,
                                       "k_max": art.rule.k_max, "source": str(art.path),
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))})
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _reference(root: Path) -> tuple[str | None, dict | None]:
    """The version a new one must agree with (target, k cap): the latest complete one deployed through this module
    (``history.json``), else ``current``'s; a link flipped by hand to a broken version is passed over, so a fix can
    always be deployed."""
    for version in (*reversed(_stack(root)), current_version(root)):
        if version is not None and (root / VERSIONS / version / DEPLOY_FILE).is_file():
            try:
                return version, version_info(root, version)
            except ArtifactError:
                continue
    return None, None


def _env(export: Path) -> dict[str, str]:
    lines = (export / "vllm.env").read_text().splitlines()
    return {key.strip(): value.strip() for key, eq, value in (line.partition("=") for line in lines) if eq}


def flip(root, name: str, version: str) -> None:
    """Point ``root/name`` at ``versions/<version>`` atomically (a link under a temporary name, then renamed)."""
    root = Path(root)
    if not (root / VERSIONS / version).is_dir():
        raise ArtifactError(f"{root / VERSIONS / version} does not exist; list the versions with python "
                            f"scripts/deploy.py --root {root} --list")
    tmp = root / f".{name}.tmp{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(f"{VERSIONS}/{version}", tmp)
    os.replace(tmp, root / name)


def history(root) -> list[dict]:
    """The flips recorded in ``root/history.json`` (``[{"action", "version", "at"}, ...]``, oldest first; none
    without the file). A file that is not that list (cut short, edited by hand) is an error naming it and the fix, never
    a parse error: rollback reads it, and a deploy appends to it."""
    path = Path(root) / HISTORY_FILE
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f"is not valid JSON ({e})"
    else:
        if isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("action"), str)
                                             and isinstance(e.get("version"), str) for e in entries):
            return entries
        problem = 'is not a list of {"action", "version", "at"} entries'
    live = current_version(root)
    raise ArtifactError(
        f"{path} {problem}: the record of the deploy root's flips is damaged, so no earlier version can be found from "
        f"it (current serves {live or 'no version'} meanwhile). Fix: restore it from a backup, or move it aside (mv "
        f"{path} {path}.damaged) and the next flip starts a new history; to roll back without it, list the versions "
        f"(python scripts/deploy.py --root {root} --list) and point current at one (--to <version>)")


def _record(root, action: str, version: str) -> None:
    entries = history(root) + [{"action": action, "version": version,
                                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    write_json(Path(root) / HISTORY_FILE, entries)


def _stack(root) -> list[str]:
    """The versions ``current`` was flipped to, a rollback undoing the last: the last is what serves now."""
    stack: list[str] = []
    for entry in history(root):
        if entry["action"] == "rollback":
            stack = stack[:-1]
        elif entry["action"] in _STACK_ACTIONS:
            stack.append(entry["version"])
    return stack


def deploy(source, root, *, drafter: str | None = None, candidate: bool = False, fraction: float | None = None,
           min_steps: int | None = None) -> Path:
    """Write ``source`` (an artifact, its directory or a vLLM export) as a new version of the deploy root ``root``
    and flip ``current`` to it, or ``candidate`` (on trial for ``fraction`` of new requests, judged after
    ``min_steps`` steps per arm: written to ``canary.json``). Returns the version's directory."""
    root = Path(root)
    if candidate and not is_deploy_root(root):
        raise ArtifactError(f"{root} serves no version yet, so a candidate has nothing to be compared with; deploy "
                            "it without --candidate first")
    version = write_version(source, root, drafter=drafter)
    if candidate:
        settings = {k: v for k, v in (("fraction", fraction), ("min_steps", min_steps)) if v is not None}
        if settings:
            write_json(root / CANARY_FILE, settings)
        flip(root, CANDIDATE, version.name)
        _record(root, "candidate", version.name)
    else:
        flip(root, CURRENT, version.name)
        _record(root, "deploy", version.name)
    return version


def rollback(root) -> str:
    """Point ``current`` back at the version it served before the last deploy, promotion or rollback undone (after
    checking that version still loads); returns its id."""
    root = Path(root)
    stack = _stack(root)
    if len(stack) < 2:
        raise ArtifactError(f"{root / HISTORY_FILE} records no earlier version of {root / CURRENT} to roll back to; "
                            f"point it at one with python scripts/deploy.py --root {root} --to <version>")
    previous = stack[-2]
    load_artifact(root / VERSIONS / previous / "policy")
    flip(root, CURRENT, previous)
    _record(root, "rollback", previous)
    return previous


def promote(root) -> str:
    """Make the candidate ``current`` (an operator's decision: the canary never promotes) and end its trial."""
    root = Path(root)
    version = current_version(root, CANDIDATE)
    if version is None:
        raise ArtifactError(f"{root} has no candidate to promote; deploy one with python scripts/deploy.py --root "
                            f"{root} --policy <artifact> --candidate")
    flip(root, CURRENT, version)
    (root / CANDIDATE).unlink(missing_ok=True)
    _record(root, "promote", version)
    return version


def point(root, version: str) -> str:
    """Point ``current`` at an existing ``version`` (recorded as a deploy)."""
    load_artifact(Path(root) / VERSIONS / version / "policy")
    flip(root, CURRENT, version)
    _record(root, "deploy", version)
    return version


def withdraw(root) -> str | None:
    """End the candidate's trial (its link removed); returns its id, None when there was none."""
    version = current_version(root, CANDIDATE)
    (Path(root) / CANDIDATE).unlink(missing_ok=True)
    if version is not None:
        _record(root, "withdraw", version)
    return version


def versions(root) -> list[str]:
    path = Path(root) / VERSIONS
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")) if path.is_dir() else []
