from django import template

register = template.Library()


@register.filter
def duration(seconds):
    """12 s, 4 min 05 s, 3 h 02 min, 2 d 4 h."""
    seconds = int(seconds or 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


@register.filter
def link_speed(mbps):
    """A network link as it is sold: 100 Gb/s, 2.5 Gb/s, 100 Mb/s."""
    if not mbps:
        return ""
    if mbps >= 1000:
        return f"{mbps / 1000:g} Gb/s"
    return f"{mbps} Mb/s"


@register.filter
def host_summary(node) -> str:
    """The machine around the GPUs in one line, from what its agent could measure: "AMD EPYC
    9354 32-Core Processor · 64 CPUs · 512 GB RAM · 6,900 GB disk free · 25 Gb/s link"."""
    parts = [node.cpu_model] if node.cpu_model else []
    if node.cpu_cores:
        parts.append(f"{node.cpu_cores} CPUs")
    if node.ram_mib:
        parts.append(f"{round(node.ram_mib / 1024):,} GB RAM")
    if node.disk_free_gb is not None:
        parts.append(f"{node.disk_free_gb:,} GB disk free")
    if node.net_link_mbps:
        parts.append(f"{link_speed(node.net_link_mbps)} link")
    return " · ".join(parts)


@register.filter
def mib_as_gib(mib) -> str:
    """24,564 MiB as "24.0 GiB": memory as the engines count it."""
    return "" if mib is None else f"{mib / 1024:,.1f} GiB"


@register.filter
def bytes_as_gib(n) -> str:
    return "" if n is None else f"{n / 2**30:,.1f} GiB"
