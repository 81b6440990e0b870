"""A minimal OTLP/HTTP traces receiver for the tests: ``python otlp_receiver.py PORT_FILE OUT``.

Binds 127.0.0.1 on a free port, writes the port to ``PORT_FILE``, and appends one JSON line per
received span to ``OUT``: ``trace_id``, ``span_id``, ``parent_span_id`` (hex, "" for a root),
``name``, ``service`` (the resource's ``service.name``) and ``attributes`` (a dict). Decodes the
protobuf ``ExportTraceServiceRequest`` with ``opentelemetry-proto`` (no collector binary is
needed). Answers every POST to ``/v1/traces`` with an empty ``ExportTraceServiceResponse``.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def spans_of(body: bytes) -> list[dict]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(), "name": s.name,
                    "service": res.get("service.name", ""),
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                })
    return out


def main(port_file: str, out: str) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.rstrip("/") != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            with open(out, "a") as f:
                f.writelines(json.dumps(s) + "\n" for s in spans_of(body))
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):  # quiet
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    import os

    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
