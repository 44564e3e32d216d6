// Package http1 frames HTTP/1.1 for kvrelay's edge proxy (the top-level README's "One
// request, folder by folder", steps 1 and 5): incremental, allocation-free parsing of request
// and response heads, chunked bodies, and the writers for the heads and chunks the proxy
// sends.
//
// The proxy runs on gnet event loops. In OnTraffic it peeks the connection's inbound
// bytes, asks this package whether a complete message is there, and discards only what
// has been consumed; otherwise it returns and waits for more bytes. Everything here is
// built for that loop:
//
//   - ParseRequest and ParseResponse take the whole buffered input and report the head's
//     length once it is complete, 0 while it is not. They keep no state between calls,
//     so a head split across reads is simply parsed again when more bytes arrive.
//   - Parsed results (Request, Response, Header) alias the input buffer: a peeked slice
//     is valid only during the callback, so copy what must outlive it.
//   - ChunkedDecoder (request bodies, de-chunked into a caller buffer) and ChunkScanner
//     (upstream response bodies, forwarded unchanged while their payload is read for
//     metrics) are small state machines that resume at any split point and never look
//     back at consumed bytes, so the caller may discard as it goes.
//   - The Append* writers append to caller-owned buffers.
//
// Nothing on these paths allocates, uses fmt, closures, maps or interface conversions
// (TestZeroAllocs proves it). Errors are sentinel *Error values carrying the status to
// answer (StatusOf); compare with errors.Is.
//
// # Strictness
//
// The proxy sits between untrusted clients and engines that parse HTTP their own way, so
// the request parser rejects what enables request smuggling or desynchronisation rather
// than guessing (RFC 9112): bare CR or LF anywhere in a head or chunk framing, obs-fold,
// whitespace before a field's colon, non-token field names, control characters in
// values, malformed or conflicting Content-Length, Transfer-Encoding together with
// Content-Length, Transfer-Encoding on HTTP/1.0, any coding but a single "chunked", a
// missing or repeated Host on HTTP/1.1, malformed percent-encoding in the target.
// README.md lists every rule with the status it answers.
//
// # Concurrency
//
// Request, Response, ChunkedDecoder and ChunkScanner live in per-connection state owned
// by one event loop and are not safe for concurrent use. The functions are safe for
// concurrent use on distinct values. Limits is a plain value.
package http1
