"""Template filters for money: micro-dollars shown as dollars (billing.pricing converts and
says the display rule: `usd` in cents, `usd_exact` to the micro-dollar where labelled)."""

from django import template

from billing.pricing import format_usd, format_usd_exact

register = template.Library()


@register.filter
def usd(micros):
    return "" if micros is None or micros == "" else format_usd(int(micros))


@register.filter
def usd_exact(micros):
    return "" if micros is None or micros == "" else format_usd_exact(int(micros))


@register.filter
def thousands(number):
    """12,345 tokens."""
    return "" if number is None else f"{int(number):,}"
