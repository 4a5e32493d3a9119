"""`saltgate prices`: the prices in effect, and a model's price set or cleared in the store."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saltgate.admin.service import AdminService, Caller

from saltgate.cli.common import _state_dir_arg, _with_service


def _add_prices(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`prices`: the store's prices, over the config's [prices] (docs/billing.md)."""
    prices = sub.add_parser(
        "prices",
        help="list the prices in effect, set a model's in the store (over the config's), "
        "or clear it",
    )
    psub = prices.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = psub.add_parser("list", help="every priced model: USD per million tokens, version, source")
    _state_dir_arg(p)
    p.set_defaults(func=_prices_list)
    p = psub.add_parser(
        "set", help="set a model's price in the store; gateways bill with it within a second"
    )
    p.add_argument("model", help="the model's name, as requests give it")
    for option, what in (
        ("--input", "uncached input"),
        ("--cached-input", "cached input"),
        ("--output", "output"),
    ):
        p.add_argument(
            option, required=True, help=f"USD per million {what} tokens (at most 6 decimals)"
        )
    _state_dir_arg(p)
    p.set_defaults(func=_prices_set)
    p = psub.add_parser(
        "clear", help="delete a model's store price: the config's applies again (or none)"
    )
    p.add_argument("model", help="the model's name")
    _state_dir_arg(p)
    p.set_defaults(func=_prices_clear)


def _price_line(price: dict[str, object]) -> str:
    return (
        f"{price['model']}\tinput {price['input_per_mtok']}\tcached_input "
        f"{price['cached_input_per_mtok']}\toutput {price['output_per_mtok']}\t"
        f"{price['version']}\t{price['source']}"
    )


def _prices_list(args: argparse.Namespace) -> int:
    async def show(service: AdminService, caller: Caller) -> str:
        return "\n".join(_price_line(p.to_dict()) for p in await service.prices_list(caller))

    return _with_service(args, show)


def _prices_set(args: argparse.Namespace) -> int:
    from saltgate.prices import price_from_fields

    async def apply(service: AdminService, caller: Caller) -> str:
        price = price_from_fields(
            {
                "input_per_mtok": args.input,
                "cached_input_per_mtok": args.cached_input,
                "output_per_mtok": args.output,
            }
        )
        return _price_line((await service.prices_set(caller, args.model, price)).to_dict())

    return _with_service(args, apply)


def _prices_clear(args: argparse.Namespace) -> int:
    async def apply(service: AdminService, caller: Caller) -> str:
        await service.prices_clear(caller, args.model)
        return f"cleared the store's price of {args.model}"

    return _with_service(args, apply)
