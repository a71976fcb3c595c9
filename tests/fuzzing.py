"""A schemathesis run over a live server's OpenAPI schema: valid requests (which must be
answered) and invalid ones (which must be refused with a 4xx), and never a 5xx."""

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st


def fuzz_statuses(base_url: str, paths: set[str], max_examples: int) -> list[int]:
    """The statuses of `max_examples` generated requests to the operations on `paths`;
    fails on the first 5xx. Derandomized, so CI sends the same requests each time."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().path in paths]
    assert {op.path for op in operations} == paths
    cases = st.one_of([op.as_strategy(mode) for op in operations for mode in GenerationMode])
    statuses: list[int] = []

    @given(case=cases)
    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case) -> None:
        response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
        statuses.append(response.status_code)

    fuzz()
    return statuses
