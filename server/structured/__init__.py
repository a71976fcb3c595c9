"""Structured output and tools: a request's output constraint (`response_format`,
`structured_outputs`, a required tool call) compiled into a grammar for the scheduler, and
tool calls in the prompt, in the answer and in the stream. The wire format stays in
server/routes/."""
