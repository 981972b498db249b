"""Checks through the warehouse's own tools that the agent added the crate of oranges."""

import json

from agentenv_protocol.tool_client import ToolSession


async def verify(mcp_url):
    async with ToolSession(mcp_url=mcp_url, timeout=30) as session:
        listed = await session.call_tool("list_crates")
    crates = json.loads(listed.text)
    return [{"id": "holds_oranges", "result": "oranges" in crates, "description": f"the warehouse holds {crates}"}]
