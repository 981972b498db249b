"""A check whose scanner is broken: it raises, so the run fails after the agent's turn and scores nothing."""


async def verify(mcp_url):
    raise RuntimeError("the crate scanner is broken")
