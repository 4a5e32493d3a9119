"""`saltgate up`: the gateway on its embedded default, simulated replicas, for a first look.

A demo composition on top of the production pieces (serving/run.py starts the gateway,
sim/run.py the replicas), so the gateway itself never imports the simulator.
"""

from __future__ import annotations

from pathlib import Path

from saltgate.admin.scopes import SCOPES
from saltgate.config import ConfigError, GatewayConfig, ReplicaConfig, create_master_key
from saltgate.runtime import run_service, until_stopped
from saltgate.serving.run import start_gateway
from saltgate.sim.run import RunningSim, start_sim
from saltgate.sim.server import SimConfig
from saltgate.store.admin_tokens import AdminTokens
from saltgate.store.errors import StoreError, TokenNotFoundError
from saltgate.store.tenants import TenantStore

DEMO_TENANTS = ("demo-alice", "demo-bob")
# Where `up` keeps the id (never the token) of the admin token it minted, to revoke it
# on the next run as it does the demo keys.
DEMO_ADMIN_TOKEN_ID = "demo-admin-token.id"  # noqa: S105 (a file name)


def demo_keys(store: TenantStore) -> list[tuple[str, str]]:
    """Make sure the demo tenants exist and mint each a fresh key for this run.

    Keys are stored only as hashes, so a key can be shown once; the previous run's demo
    keys are revoked, while the tenants (and so their warm caches) stay.
    """
    existing = {t.name for t in store.list_tenants()}
    minted = []
    for name in DEMO_TENANTS:
        if name not in existing:
            store.create_tenant(name)
        for key in store.list_keys(name):
            if key.revoked_at is None:
                store.revoke_key(key.id)
        _, key_value = store.create_key(name)
        minted.append((name, key_value))
    return minted


def demo_admin_token(store: TenantStore, state_dir: Path) -> str:
    """Mint an admin token with every scope for this run, revoking the previous run's."""
    tokens = AdminTokens(store.db, store.actor)
    kept = state_dir / DEMO_ADMIN_TOKEN_ID
    if kept.exists():
        try:
            if tokens.get(kept.read_text().strip()).revoked_at is None:
                tokens.revoke(kept.read_text().strip())
        except TokenNotFoundError:
            pass  # a new database in an old state directory
    token_id, token = tokens.create(SCOPES)
    kept.write_text(token_id + "\n")
    return token


async def _up(port: int, replicas: int, state_dir: Path, sim_base_port: int) -> None:
    sims: list[RunningSim] = []
    for i in range(replicas):
        sim_port = sim_base_port + i if sim_base_port else 0
        sims.append(await start_sim(SimConfig(port=sim_port)))
    config = GatewayConfig(
        replicas=tuple(ReplicaConfig(s.url) for s in sims),
        state_dir=state_dir,
        master_key_file=state_dir / "master.key",
        ehbp_key_file=state_dir / "hpke.key",  # kept: clients pinned it
        port=port,
        admin_port=port + 1 if port else 0,
    )
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    create_master_key(config.master_key_file)
    store = TenantStore(config.db_path)
    try:
        keys = demo_keys(store)
        admin_token = demo_admin_token(store, state_dir)
    finally:
        store.close()
    running = await start_gateway(config)
    model = sims[0].server.config.model
    print(f"saltgate up: gateway on {running.url} with {replicas} simulated replicas", flush=True)
    admin_url = f"http://{config.admin_host}:{running.admin_port}"
    print(f"  metrics:  {admin_url}/metrics (with the admin token: usage:read)")
    print(f"  admin API: {admin_url}/admin/v1/ (docs/admin-api.md)")
    print(f"  admin token (every scope): {admin_token}")
    print(f"  console:  {admin_url}/console/ (sign in with the admin token)")
    print(f"  state:    {state_dir}")
    if running.ehbp is not None:
        fingerprint = running.ehbp.keyring.current.config.fingerprint
        print(f"  EHBP key: {fingerprint} (in {config.ehbp_key_file}; pin it)")
    for name, key in keys:
        print(f"  tenant {name}: API key {key}")
    print(
        f"  admin:    curl -s {admin_url}/admin/v1/tenants -H 'Authorization: Bearer {admin_token}'"
    )
    print(
        f"  try: curl -s {running.url}/v1/completions -H 'Authorization: Bearer {keys[0][1]}' "
        f"-H 'content-type: application/json' "
        f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 8}}\'',
        flush=True,
    )
    await until_stopped()
    await running.close()
    for sim in sims:
        await sim.close()


def up(port: int, replicas: int, state_dir: Path, sim_base_port: int = 0) -> int:
    return run_service(
        lambda: _up(port, replicas, state_dir, sim_base_port),
        "saltgate up",
        cannot_run=f"cannot serve on port {port}",
        usage_errors=(ConfigError, StoreError),  # a state dir of an older schema: exit 2
    )
