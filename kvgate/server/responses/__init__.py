"""OpenAI's Responses API (``/v1/responses``): function tools and ``file_search``,
``text.format``, whole, streamed or in the background, stored and chained.

- ``protocol``: the request body;
- ``items``: a request in chat's terms, and stored items back as input;
- ``file_search``: the search and the sources in the prompt;
- ``answer``: the output items, the response object, the stream's events;
- ``stored``: the rows of stored responses; ``background``: this process's runs;
- ``create``: one response from request to answer; ``routes``: the endpoints.
"""

from kvgate.server.responses.routes import install_response_routes

__all__ = ["install_response_routes"]
