"""A gateway configuration file for tests that run `saltgate serve` or read the file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def write_gateway_config(
    path: Path,
    *,
    state_dir: Path,
    replica_urls: Iterable[str],
    port: int = 0,
    admin_port: int | None = None,
    master_key_file: Path | None = None,
    replica_key_env: str | None = None,
    salting: bool = True,
    sections: str = "",
) -> Path:
    """Write the file and return its path; ``sections``: further tables, as TOML."""
    lines = ["[gateway]", f"port = {port}", f'state_dir = "{state_dir}"']
    if admin_port is not None:
        lines.append(f"admin_port = {admin_port}")
    if master_key_file is not None:
        lines.append(f'master_key_file = "{master_key_file}"')
    for url in replica_urls:
        lines += ["[[replicas]]", f'url = "{url}"']
        if replica_key_env:
            lines.append(f'api_key_env = "{replica_key_env}"')
    if not salting:
        lines += ["[testing]", "disable_salting = true"]
    path.write_text("\n".join(lines) + "\n" + sections)
    return path
