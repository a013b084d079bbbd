"""The dashboard at ``/ui/``: server-rendered pages over the queue operations, logged in
with the HTTP API's tokens (:mod:`jsqueue.ui.app`)."""
