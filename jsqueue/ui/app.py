"""The dashboard at ``/ui/`` on the process's HTTP endpoint, beside the HTTP API.

Routes (docs/architecture.md, "Dashboard"):

* ``GET /ui/login``, ``POST /ui/login`` - the token form; ``POST /ui/logout``;
* ``GET /ui/`` - overview: depth by state and by destination over time, the oldest
  entry, outcomes per minute (:mod:`jsqueue.ui.history`, memory only);
* ``GET /ui/queue`` - the searchable list (state, domain, sender, recipient; paged);
  a queue id in ``id`` opens that message;
* ``GET /ui/queue/{id}`` - one message: recipients, attempts with their replies, leases;
* ``GET /ui/queue/{id}/{action}`` - the confirmation of an action, ``POST`` the same
  path does it through :meth:`jsqueue.admin.Admin.act` (``ui:<token name>`` as the
  events' source) and redirects to the message (RFC 9110 §15.4.4, 303);
* ``GET /ui/destinations`` - only when a :class:`~jsqueue.ui.pages.Destinations` hook
  is given;
* ``/ui/static/`` - the stylesheet and htmx (vendored, 0BSD licence beside it).

Every page but the login needs the login cookie of a ``read`` or ``admin`` token
(:mod:`jsqueue.ui.session`); without one a page redirects to the login form. Action
pages need ``admin`` (403 otherwise, and a read token is shown no action button) and
every post that acts needs the session's CSRF token (403 otherwise). Responses carry a
Content-Security-Policy allowing only this origin's scripts and styles.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web
from pydantic import ValidationError

from jsqueue.envelope import EntryState, utcnow
from jsqueue.errors import EntryNotFound, InvalidName, StoreError
from jsqueue.http.app import ApiMount
from jsqueue.http.auth import Role, Token
from jsqueue.http.context import ApiContext
from jsqueue.names import Names, check_queue_id
from jsqueue.ui import pages
from jsqueue.ui.history import DepthHistory, OutcomeCounter, Sampling
from jsqueue.ui.session import clear_login, csrf_ok, csrf_token, logged_in, set_login
from jsqueue.views import Action, Outcome

log = logging.getLogger("jsqueue.ui")

PREFIX = "/ui/"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_ACTION_TEXT = {
    Action.FLUSH: "Deliver now, overriding the retry schedule. An attempt in progress "
    "finishes first.",
    Action.HOLD: "Put on hold: nothing is attempted until it is released.",
    Action.RELEASE: "Release from hold and deliver now.",
    Action.DELETE: "Delete the message, its body and its work items. No DSN is sent. "
    "This cannot be undone.",
    Action.BOUNCE: "Bounce every open recipient (550 5.7.1) and send the failure DSN "
    "to the reverse-path. This cannot be undone.",
    Action.REQUEUE: "Requeue: leases dropped, due now, attempt counts kept.",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The request's session: its token and the token's secret (set before a page runs).
SESSION_KEY = web.RequestKey("jsqueue_ui_session", tuple[Token, str])


def static_dir() -> Path:
    """The package's static files (installed as package data)."""
    return Path(str(resources.files("jsqueue.ui") / "static"))


class Dashboard:
    """The dashboard's pages over the API's shared state.

    Args:
        ctx: what the API's handlers share (settings, stores, tokens, observer).
        destinations: the destinations hook, or None for no destinations section.
    """

    def __init__(self, ctx: ApiContext, destinations: pages.Destinations | None = None) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.ui = ctx.settings.ui
        self.destinations = destinations
        reader = ctx.admin(Token("dashboard", Role.READ))
        self.history = DepthHistory(
            reader, interval_s=self.ui.sample_interval_s, keep=self.ui.history_samples
        )
        self.outcomes = OutcomeCounter(self.ui.outcome_minutes)
        names = Names(self.settings.nats.prefix)
        self.sampling = Sampling(
            self.history,
            self.outcomes,
            lambda: self.outcomes.follow(self.settings.nats, ctx.urls, names=names),
            idle_s=self.ui.idle_s,
        )
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("jsqueue.ui", "templates"),
            autoescape=True,
            undefined=jinja2.ChainableUndefined,
        )
        self.env.filters["age"] = pages.age
        self.env.filters["when"] = lambda d: d.strftime("%Y-%m-%d %H:%M:%S") if d else "-"

    # ------------------------------------------------------------------ plumbing

    def mount(self, app: web.Application) -> None:
        """Add the routes, the security headers and the background samplers to ``app``."""
        app.middlewares.append(_headers)
        r = app.router
        r.add_get("/ui", self.root)
        r.add_get("/ui/login", self.login_form)
        r.add_post("/ui/login", self.login)
        r.add_post("/ui/logout", self.logout)
        r.add_get("/ui/", self._page(self.overview))
        r.add_get("/ui/queue", self._page(self.queue))
        r.add_get("/ui/queue/{queue_id}", self._page(self.message))
        r.add_get("/ui/queue/{queue_id}/{action}", self._page(self.confirm))
        r.add_post("/ui/queue/{queue_id}/{action}", self._page(self.act))
        if self.destinations is not None:
            r.add_get("/ui/destinations", self._page(self.destinations_page))
        r.add_static("/ui/static/", static_dir(), append_version=False)
        app.cleanup_ctx.append(self._background)

    async def _background(self, app: web.Application) -> AsyncIterator[None]:
        """Nothing runs until a page is viewed (:class:`Sampling`); stop it on shutdown."""
        yield
        await self.sampling.close()

    def render(
        self, request: web.Request, template: str, status: int = 200, **values: Any
    ) -> web.Response:
        """The HTML page ``template`` with ``values`` and the session's values."""
        session = request.get(SESSION_KEY)
        token: Token | None = session[0] if session else None
        html = self.env.get_template(template).render(
            token=token,
            admin=token is not None and token.allows(Role.ADMIN),
            csrf=csrf_token(session[1]) if session else "",
            destinations=self.destinations is not None,
            path=request.path,
            **values,
        )
        return web.Response(text=html, status=status, content_type="text/html")

    def _page(self, handler: Handler) -> Handler:
        async def serve(request: web.Request) -> web.StreamResponse:
            session = logged_in(request, self.ctx.tokens)
            if session is None or not session[0].allows(Role.READ):
                if request.method != "GET":
                    return self.render(request, "error.html", 401, message="Log in first.")
                return _redirect("/ui/login?" + urlencode({"next": request.path_qs}))
            request[SESSION_KEY] = session
            self.sampling.viewed()
            try:
                return await handler(request)
            except StoreError as e:
                log.warning("dashboard %s %s: %s", request.method, request.path, e)
                return self.render(
                    request, "error.html", 503, message=f"The queue cannot be read now: {e}"
                )

        return serve

    def _admin_only(self, request: web.Request) -> web.Response | None:
        token: Token = request[SESSION_KEY][0]
        if not token.allows(Role.ADMIN):
            return self.render(
                request,
                "error.html",
                403,
                message=f"Token {token.name!r} has role {token.role.value}: actions need admin.",
            )
        return None

    # ------------------------------------------------------------------ login

    async def root(self, request: web.Request) -> web.StreamResponse:
        """``/ui`` → ``/ui/``."""
        return _redirect(PREFIX)

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        """The token form (``next``: where to go afterwards)."""
        return self.render(request, "login.html", next=_local(request.query.get("next")))

    async def login(self, request: web.Request) -> web.StreamResponse:
        """Check the posted token; a read or admin token gets the login cookie."""
        form = await request.post()
        secret = str(form.get("token", "")).strip()
        target = _local(str(form.get("next", "")))
        token = self.ctx.tokens.authenticate(secret) if secret else None
        if token is None or not token.allows(Role.READ):
            why = "Unknown token." if token is None else "An inject token cannot see the queue."
            log.info("dashboard login refused from %s: %s", request.remote, why)
            return self.render(request, "login.html", 401, next=target, error=why)
        log.info("dashboard login: token %s (%s)", token.name, token.role.value)
        response = _redirect(target)
        secure = request.secure or self.ui.secure_cookie
        set_login(response, secret, secure=secure, max_age_s=self.ui.session_max_age_s)
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        """Drop the login cookie (the post must carry the CSRF token)."""
        session = logged_in(request, self.ctx.tokens)
        form = await request.post()
        if session is not None and not csrf_ok(request, session[1], _str(form.get("csrf"))):
            return self.render(request, "error.html", 403, message="Missing or wrong CSRF token.")
        response = _redirect("/ui/login")
        clear_login(response)
        return response

    # ------------------------------------------------------------------ pages

    async def overview(self, request: web.Request) -> web.StreamResponse:
        """Depth over time, the oldest entry, outcomes per minute: memory only."""
        return self.render(request, "overview.html", **pages.overview(self.history, self.outcomes))

    async def queue(self, request: web.Request) -> web.StreamResponse:
        """The searchable, paged list."""
        wanted = request.query.get("id", "").strip()
        if wanted:
            try:
                return _redirect(f"/ui/queue/{check_queue_id(wanted)}")
            except InvalidName as e:
                return await self._list(request, pages.Search.of(request.query), error=str(e))
        return await self._list(request, pages.Search.of(request.query))

    async def _list(
        self, request: web.Request, search: pages.Search, error: str | None = None
    ) -> web.StreamResponse:
        found: pages.Listing | None = None
        problem = error
        if problem is None:
            try:
                found = await pages.listing(
                    self.ctx.admin(request[SESSION_KEY][0]),
                    search,
                    self.ui.page_size,
                    self.ui.search_budget_s,
                )
            except ValidationError as e:
                problem = _search_problem(e)
            except InvalidName as e:
                problem = str(e)
        next_url = None
        if found is not None and found.next_after:
            next_url = "/ui/queue?" + urlencode({**search.query, "after": found.next_after})
        return self.render(
            request,
            "queue.html",
            422 if problem else 200,
            search=search,
            listing=found,
            error=problem,
            next_url=next_url,
            states=[""] + [s.value for s in EntryState],
        )

    async def message(self, request: web.Request) -> web.StreamResponse:
        """One message: entry, attempts with replies (events stream), leases."""
        try:
            queue_id = check_queue_id(request.match_info["queue_id"])
        except InvalidName as e:
            return self.render(request, "error.html", 404, message=str(e))
        detail = None
        with contextlib.suppress(EntryNotFound):
            detail = await self.ctx.admin(request[SESSION_KEY][0]).show(queue_id)
        hist = await pages.history(self.settings, self.ctx.urls, queue_id, self.ui.history_budget_s)
        if detail is None and not hist.events:
            return self.render(request, "error.html", 404, message=f"No message {queue_id}.")
        did = request.query.get("did")
        return self.render(
            request,
            "message.html",
            queue_id=queue_id,
            actions=[a.value for a in Action],
            did=did,
            outcome=request.query.get("outcome"),
            outcome_detail=request.query.get("detail"),
            **pages.message(detail, hist, utcnow()),
        )

    def _action(self, request: web.Request) -> tuple[str, Action] | web.Response:
        try:
            queue_id = check_queue_id(request.match_info["queue_id"])
            action = Action(request.match_info["action"])
        except (InvalidName, ValueError):
            return self.render(request, "error.html", 404, message="No such page.")
        return queue_id, action

    async def confirm(self, request: web.Request) -> web.StreamResponse:
        """The confirmation step of an action (admin only)."""
        denied = self._admin_only(request)
        if denied is not None:
            return denied
        target = self._action(request)
        if isinstance(target, web.Response):
            return target
        queue_id, action = target
        return self.render(
            request,
            "confirm.html",
            queue_id=queue_id,
            action=action.value,
            explain=_ACTION_TEXT[action],
        )

    async def act(self, request: web.Request) -> web.StreamResponse:
        """Do a confirmed action (admin only, CSRF checked) and show the message again."""
        denied = self._admin_only(request)
        if denied is not None:
            return denied
        form = await request.post()
        token, secret = request[SESSION_KEY]
        if not csrf_ok(request, secret, _str(form.get("csrf"))):
            return self.render(request, "error.html", 403, message="Missing or wrong CSRF token.")
        target = self._action(request)
        if isinstance(target, web.Response):
            return target
        queue_id, action = target
        admin = self.ctx.admin(token)
        admin.source = f"ui:{token.name}"
        result = await admin.act(action, queue_id)
        log.info(
            "ui %s %s by %s: %s %s",
            action.value,
            queue_id,
            token.name,
            result.outcome.value,
            result.detail,
        )
        if result.outcome is Outcome.FAILED:
            return self.render(
                request, "error.html", 503, message=f"{action.value} failed: {result.detail}"
            )
        query = {"did": action.value, "outcome": result.outcome.value, "detail": result.detail}
        return _redirect(f"/ui/queue/{queue_id}?" + urlencode(query), status=303)

    async def destinations_page(self, request: web.Request) -> web.StreamResponse:
        """The destinations table from the hook."""
        assert self.destinations is not None
        rows = await self.destinations()
        columns = list(dict.fromkeys(k for row in rows for k in row))
        return self.render(request, "destinations.html", rows=rows, columns=columns)


def _search_problem(e: ValidationError) -> str:
    """``state: Input should be 'held', ...; domain: ...``: what is wrong with each field
    of the list's search, by its name in the form."""
    parts = []
    for err in e.errors(include_url=False):
        field = str(err["loc"][0]) if err["loc"] else "search"
        parts.append(f"{'state' if field == 'states' else field}: {err['msg']}")
    return "; ".join(parts)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


#: A URI reference's characters: printable ASCII, the rest percent-encoded (RFC 3986 §2).
_URI_TEXT = re.compile(r"[!-~]+")


def _local(target: str | None) -> str:
    """``target`` when it is a path of the dashboard (no open redirect) written as a URI is,
    in printable ASCII (RFC 3986 §2: a CR LF would end the Location header field), else
    ``/ui/``."""
    if target and target.startswith(PREFIX) and _URI_TEXT.fullmatch(target):
        return target
    return PREFIX


def _redirect(location: str, status: int = 302) -> web.Response:
    return web.Response(status=status, headers={"Location": location})


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Under ``/ui``: no caching of pages, the CSP, no framing, no MIME sniffing."""
    response = await handler(request)
    if request.path == "/ui" or request.path.startswith(PREFIX):
        response.headers.setdefault("Content-Security-Policy", _CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        if not request.path.startswith("/ui/static/"):
            response.headers.setdefault("Cache-Control", "no-store")
    return response


class DashboardMount:
    """The HTTP API and the dashboard on one endpoint (a :class:`jsqueue.health.Extension`).

    Args:
        api: the API's mount; its shared state serves the dashboard too.
        destinations: the destinations hook (see :class:`~jsqueue.ui.pages.Destinations`);
            None until destination limits exist.
    """

    def __init__(self, api: ApiMount, destinations: pages.Destinations | None = None) -> None:
        self.api = api
        self.dashboard = Dashboard(api.context, destinations)
        self.client_max_size = api.client_max_size

    def __call__(self, app: web.Application) -> None:
        """Add the API's and the dashboard's routes to ``app``."""
        self.api(app)
        self.dashboard.mount(app)
