//! router: the OpenAI-compatible HTTP API. Filled by the router issue.

pub mod openai;
