"""Template filters for money: micro-dollars shown as dollars (billing.pricing converts)."""

from django import template

from billing.pricing import format_usd

register = template.Library()


@register.filter
def usd(micros):
    return "" if micros is None or micros == "" else format_usd(int(micros))


@register.filter
def usd_per_mtok(micros_per_mtok):
    return "" if micros_per_mtok is None else f"{format_usd(int(micros_per_mtok))} / 1M tokens"


@register.filter
def thousands(number):
    """12,345 tokens."""
    return "" if number is None else f"{int(number):,}"
