"""Memory sizes as operators write them on the command line ('512MiB', '1.5GB'), parsed
exactly: a flag's budget must be the bytes the user meant, not a float's rounding of them."""

import re
from decimal import Decimal

# Lower-cased unit -> bytes: KB .. TB are powers of 1000, KiB .. TiB powers of 1024.
_MEMORY_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{prefix}b": 1000**power for power, prefix in enumerate("kmgt", start=1)},
    **{f"{prefix}ib": 1024**power for power, prefix in enumerate("kmgt", start=1)},
}
_MEMORY_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as '512MiB', '4GiB', '1.5GB' or '1000000' (fractions floored)."""
    match = _MEMORY_SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _MEMORY_UNITS:
        raise ValueError(
            f"invalid memory size {text!r}: expected a non-negative number with an optional "
            "unit, one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of "
            "1024), e.g. '512MiB' or '1.5GB'"
        )
    # Decimal, not float: '1.1GB' must be exactly 1100000000 bytes.
    return int(Decimal(match.group(1)) * _MEMORY_UNITS[unit])
