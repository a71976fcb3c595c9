"""The pydantic models the LangChain tests hand to `with_structured_output` and
`bind_tools`, shared by the OpenAI and the Anthropic integrations' tests. The bounds keep
a small model's answer short enough to finish inside the tests' token limits."""

from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Multiply(BaseModel):
    """Multiply two integers."""

    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)
