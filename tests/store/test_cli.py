"""The admin commands (`saltgate tenants|keys|usage`) with --config, on either backend,
and with --state-dir (SQLite) as before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from saltgate.cli import main
from saltgate.governance.limits import Limits
from saltgate.store.backends import open_gateway_store
from saltgate.store.ledger import UsageRecord, new_request_id
from saltgate.store.settings import StoreSettings


def _saltgate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_admin_commands_work_on_the_configured_store(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstate_dir = "{tmp_path / "state"}"\n{store_settings.toml()}'
        '[[replicas]]\nurl = "http://127.0.0.1:1"\n'
        "[prices.m]\ninput = 1.0\ncached_input = 0.5\noutput = 2.0\n"
    )
    c = ("--config", str(config))
    assert _saltgate(capsys, "tenants", "create", "acme", *c)[:2] == (0, "created tenant acme")
    code, key, err = _saltgate(capsys, "keys", "create", "acme", *c)
    assert code == 0 and key.startswith("sg_") and err.startswith("created key_")
    code, listed, _ = _saltgate(capsys, "keys", "list", *c)
    assert code == 0 and key not in listed
    assert listed.endswith("\tactive\tpriority interactive\tlimits none")
    # A batch key: its band is listed, and it authenticates as batch (the fair queue's).
    code, batch_key, err = _saltgate(capsys, "keys", "create", "acme", "--priority", "batch", *c)
    assert code == 0 and batch_key.startswith("sg_") and "(batch)" in err
    batch_line = _saltgate(capsys, "keys", "list", *c)[1].splitlines()[-1]
    assert batch_line.endswith("\tactive\tpriority batch\tlimits none")

    async def bands() -> list[str | None]:
        store = await open_gateway_store(store_settings)
        found = [store.keys.authenticate(k) for k in (key, batch_key)]
        await store.aclose()
        return [None if p is None else p.priority for p in found]

    assert asyncio.run(bands()) == ["interactive", "batch"]
    with pytest.raises(SystemExit):  # only the two bands
        main(["keys", "create", "acme", "--priority", "urgent", *c])
    capsys.readouterr()
    code, tenants, _ = _saltgate(capsys, "tenants", "list", *c)
    tenant_id = tenants.split("\t")[0]
    assert _saltgate(capsys, "tenants", "rotate-salt", "acme", *c)[1].endswith("epoch 1")
    assert tenants.endswith("\tmodels all\tlimits none\tweight 1")
    set_models = ("tenants", "set-models", "acme")
    assert _saltgate(capsys, *set_models, "m2, m1", *c)[1] == "tenant acme may use models m1,m2"
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith(
        "\tepoch 1\tmodels m1,m2\tlimits none\tweight 1"
    )
    code, _, err = _saltgate(capsys, *set_models, " , ", *c)
    assert code == 1 and "invalid model list" in err
    with pytest.raises(SystemExit):  # a list or --all, not both
        main([*set_models, "m1", "--all", *c])
    assert _saltgate(capsys, *set_models, "--all", *c)[1] == "tenant acme may use models all"
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith(
        "\tmodels all\tlimits none\tweight 1"
    )

    set_limits = ("tenants", "set-limits", "acme")
    code, out, _ = _saltgate(
        capsys,
        *set_limits,
        "--rpm",
        "60",
        "--input-tpm",
        "10000",
        "--output-tpm",
        "2000",
        "--concurrency",
        "4",
        "--budget-usd",
        "12.5",
        "--budget-period",
        "30d",
        *c,
    )
    expected = "rpm=60 input_tpm=10000 output_tpm=2000 concurrency=4 budget=$12.5/30d"
    assert (code, out.splitlines()[0]) == (0, f"tenant acme limits {expected}\tweight 1")
    assert out.splitlines()[1].startswith("enforced: exactly")  # how they are held, in words
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith(f"\tlimits {expected}\tweight 1")
    for bad, message in (
        (("--budget-usd", "0.0000001", "--budget-period", "1d"), "at most 6 decimals"),
        (("--budget-usd", "5", "--budget-period", "soon"), "budget_period must be a duration"),
        (("--rpm", "-1"), "limit rpm must be from 0 to"),
        (("--rpm", "18446744073709551615"), "limit rpm must be from 0 to"),
        (("--rpm", "5", "--clear"), "--clear alone"),
        (("--clear", "rps"), "cannot clear 'rps'"),
        (("--rpm", "5", "--clear", "rpm"), "rpm is both set and cleared"),
        ((), "give at least one"),
    ):
        code, _, err = _saltgate(capsys, *set_limits, *bad, *c)
        assert code == 1 and message in err, (bad, err)
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith(f"\tlimits {expected}\tweight 1")
    # An edit: what is named changes, the rest stays (issue 42: it was all replaced).
    code, out, _ = _saltgate(capsys, *set_limits, "--rpm", "10", "--budget-usd", "5", *c)
    edited = "rpm=10 input_tpm=10000 output_tpm=2000 concurrency=4 budget=$5/30d"
    assert (code, out.splitlines()[0]) == (0, f"tenant acme limits {edited}\tweight 1")
    code, out, _ = _saltgate(capsys, *set_limits, "--clear", "budget", "--clear", "rpm", *c)
    assert (code, out.splitlines()[0]) == (
        0,
        "tenant acme limits input_tpm=10000 output_tpm=2000 concurrency=4\tweight 1",
    )
    code, _, err = _saltgate(capsys, *set_limits, "--budget-usd", "5", *c)
    assert code == 1 and "a budget needs both" in err  # no period left to keep
    key_id = listed.split("\t")[0]
    code, out, _ = _saltgate(capsys, "keys", "set-limits", key_id, "--rpm", "5", *c)
    assert (code, out.splitlines()[0]) == (0, f"key {key_id} limits rpm=5")
    first_line = _saltgate(capsys, "keys", "list", *c)[1].splitlines()[0]
    assert first_line.endswith("\tpriority interactive\tlimits rpm=5")
    assert (
        _saltgate(capsys, *set_limits, "--clear", *c)[1].splitlines()[0]
        == "tenant acme limits none\tweight 1"
    )
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith("\tlimits none\tweight 1")

    async def meter() -> None:
        store = await open_gateway_store(store_settings)
        for prompt, status in ((1000, 200), (10, 429)):
            rec = UsageRecord(new_request_id(), 5.0, tenant_id, "key_x", "m", prompt, 0, 10, status)
            await store.ledger.record(rec)
        await store.aclose()

    asyncio.run(meter())
    code, out, _ = _saltgate(capsys, "usage", "--json", *c)
    assert code == 0
    [row] = json.loads(out)
    assert (row["tenant"], row["requests"], row["errors"], row["prompt_tokens"]) == (
        "acme",
        2,
        1,
        1010,
    )
    # Recorded without a cost (no prices given to the ledger): priced now, and flagged.
    assert row["cost_usd"] == "0.001050" and row["priced_at_report_requests"] == 2
    # Closing a month: [since, until) in UTC, any grouping, exact decimal strings.
    month = ("usage", "--since", "1970-01-01", "--group-by", "day,model", "--csv", *c)
    code, out, _ = _saltgate(capsys, *month, "--until", "1970-01-01T00:00:05")
    assert code == 0 and out.splitlines()[1:] == []  # the records' ts 5.0 is the until
    code, out, _ = _saltgate(capsys, *month, "--until", "1970-01-01T00:00:05.001")
    header, line = out.splitlines()
    assert header.split(",")[:4] == ["model", "day", "requests", "errors"]
    assert line.split(",")[:4] == ["m", "1970-01-01", "2", "1"] and "0.001050" in line
    code, out, _ = _saltgate(capsys, "usage", "--until", "1970-01-02", "--group-by", "key,day", *c)
    assert code == 0 and out.splitlines()[1].split()[:3] == ["key_x", "1970-01-01", "2"]
    for bad in (("--group-by", "week"), ("--since", "2026-02-01", "--until", "2026-01-01")):
        code, _, err = _saltgate(capsys, "usage", *bad, *c)
        assert code == 1 and err.startswith("saltgate usage: --")
    code, _, err = _saltgate(capsys, "tenants", "create", "acme", *c)
    assert code == 1 and "'acme' already exists" in err


def test_state_dir_alone_is_the_sqlite_store_it_always_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "state")
    assert _saltgate(capsys, "tenants", "create", "acme", "--state-dir", state)[0] == 0
    assert (tmp_path / "state" / "saltgate.db").exists()
    code, _, err = _saltgate(capsys, "usage", "--state-dir", str(tmp_path / "nope"))
    assert code == 1 and "no saltgate database at" in err
    assert not (tmp_path / "nope").exists()


def test_an_unreachable_store_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[store]\nurl = "postgresql://sg@127.0.0.1:1/x?connect_timeout=2"\n'
        '[[replicas]]\nurl = "http://127.0.0.1:1"\n'
    )
    code, _, err = _saltgate(capsys, "keys", "list", "--config", str(config))
    assert code == 1
    assert err.startswith("saltgate keys: cannot reach the store postgresql://sg@127.0.0.1:1/x")
    assert "\n" not in err and "Traceback" not in err


def test_a_tenants_weight_is_set_listed_and_refused_on_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tenants set-limits NAME --weight W` still sets the weight, now the tenant's own
    setting beside its limits (issue 42): an edit of the limits keeps it, setting it keeps
    the limits, `--clear weight` puts it back to 1 and a bare `--clear` (every limit) leaves
    it; it is listed and reaches the gateway's principal (a weight alone is no limit:
    admission stays skipped); a bad weight and a weight on a key are one clear line each."""
    c = ("--state-dir", str(tmp_path / "state"))
    assert _saltgate(capsys, "tenants", "create", "acme", *c)[0] == 0
    code, key, _ = _saltgate(capsys, "keys", "create", "acme", *c)
    assert code == 0
    set_limits = ("tenants", "set-limits", "acme")
    code, out, _ = _saltgate(capsys, *set_limits, "--weight", "2", *c)
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits none\tweight 2")
    code, out, _ = _saltgate(capsys, *set_limits, "--rpm", "60", *c)  # the weight stays
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits rpm=60\tweight 2")
    code, out, _ = _saltgate(capsys, *set_limits, "--weight", "0.5", *c)  # the rpm stays
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits rpm=60\tweight 0.5")
    assert _saltgate(capsys, "tenants", "list", *c)[1].endswith("\tlimits rpm=60\tweight 0.5")
    # 5e-324 broke the fair queue for every tenant (issue 41 finding 1).
    for bad in ("0", "-1", "nan", "inf", "abc", "5e-324", "1e308"):
        code, _, err = _saltgate(capsys, *set_limits, "--weight", bad, *c)
        assert code == 1 and "weight must be a number from 0.01 to 100" in err, (bad, err)
    code, _, err = _saltgate(capsys, *set_limits, "--weight", "", *c)
    assert code == 1 and "give at least one" in err
    code, _, err = _saltgate(capsys, *set_limits, "--weight", "2", "--clear", *c)
    assert code == 1 and "--clear alone" in err
    code, _, err = _saltgate(capsys, *set_limits, "--weight", "2", "--clear", "weight", *c)
    assert code == 1 and "weight is both set and cleared" in err
    key_id = _saltgate(capsys, "keys", "list", *c)[1].split("\t")[0]
    for given in (("--weight", "2"), ("--clear", "weight")):
        code, _, err = _saltgate(capsys, "keys", "set-limits", key_id, *given, *c)
        assert code == 1 and "a key cannot set it" in err and "\n" not in err, given
    assert _saltgate(capsys, "keys", "list", *c)[1].endswith("\tlimits none")
    code, out, _ = _saltgate(capsys, *set_limits, "--weight", "3", "--clear", "rpm", *c)
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits none\tweight 3")

    async def principal() -> tuple[float, Limits | None, bool]:
        store = await open_gateway_store(StoreSettings.in_state_dir(tmp_path / "state"))
        found = store.keys.authenticate(key)
        await store.aclose()
        assert found is not None
        return found.weight, found.limits, found.limited

    assert asyncio.run(principal()) == (3.0, None, False)
    _saltgate(capsys, *set_limits, "--rpm", "5", *c)
    code, out, _ = _saltgate(capsys, *set_limits, "--clear", *c)  # every limit; not the weight
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits none\tweight 3")
    code, out, _ = _saltgate(capsys, *set_limits, "--clear", "weight", *c)
    assert (code, out.splitlines()[0]) == (0, "tenant acme limits none\tweight 1")
    assert asyncio.run(principal()) == (1.0, None, False)


def test_admin_commands_without_a_store_refuse_instead_of_making_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`./.state` was created silently, and a token minted there was the gateway's to
    refuse (issue 43); an existing one is still taken."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _saltgate(capsys, "admin-tokens", "create", "--scopes", "all")
    assert code == 1 and "give --config FILE" in err and "nothing was created" in err, err
    assert out == "" and not (tmp_path / ".state").exists()
    assert _saltgate(capsys, "tenants", "create", "acme", "--state-dir", ".state")[0] == 0
    code, out, _ = _saltgate(capsys, "tenants", "list")  # the existing store, by default
    assert code == 0 and out.split("\t")[1] == "acme", out
