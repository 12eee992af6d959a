"""`harness push RUN_DIR REPO_ID`: upload a run's final/ export (with its model card) to the Hugging Face hub.

    harness push runs/default me/my-model [--private] [--revision BRANCH] [--token TOKEN]

The token is --token, else HF_TOKEN or the login of `huggingface-cli login`. The model card final/README.md is
written again first, with REPO_ID in its loading examples. The repository is created when missing
(create_repo(exist_ok=True)); --revision pushes to that branch (created from main when missing). Offline
(HF_HUB_OFFLINE=1), without network, or refused by the hub: one error line naming the repository, exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.errors import ConfigError, HarnessError
from harness.observe.modelcard import try_write_model_card


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="harness push", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run folder holding final/ (e.g. runs/default)")
    p.add_argument("repo_id", help="hub repository, e.g. me/my-model")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", "--branch", dest="revision", default=None, help="branch to push to [main]")
    p.add_argument("--token", default=None, help="hub token [HF_TOKEN, or the saved login]")
    return p.parse_args(argv)


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (at import), or as set in the environment now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def push(run_dir: str, repo_id: str, private: bool = False, revision: str | None = None,
         token: str | None = None) -> str:
    """Upload run_dir/final to repo_id; returns the commit URL. HarnessError (one line) on any failure."""
    final = Path(run_dir) / "final"
    if not final.is_dir():
        raise ConfigError(f"{final} not found: push uploads a finished run's final/ export (train.save_final=true)")
    if offline():
        raise HarnessError(f"cannot push to {repo_id}: the hub is offline (HF_HUB_OFFLINE is set)")
    if (Path(run_dir) / "config.yaml").is_file() and (Path(run_dir) / "report.json").is_file():
        try_write_model_card(run_dir, lambda m: print(m, file=sys.stderr), final_dir=final, repo=repo_id)
    from huggingface_hub import HfApi

    api = HfApi(token=token or None)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=final, revision=revision,
                                 commit_message=f"harness push {final}")
    except Exception as e:  # noqa: BLE001 - network, auth, offline: one line, no traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HarnessError(f"cannot push to {repo_id}: {type(e).__name__}: {first}") from None
    return getattr(info, "commit_url", str(info))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    url = push(args.run_dir, args.repo_id, args.private, args.revision, args.token or os.environ.get("HF_TOKEN"))
    print(f"[harness] pushed {Path(args.run_dir) / 'final'} to {args.repo_id}: {url}")
    return 0
