package http1

// Error is a framing error together with the HTTP status the proxy answers it with. Every
// error this package returns is one of the sentinel *Error values below, so callers compare
// with errors.Is (or ==) and read the status with StatusOf. After any error the bytes on the
// connection can no longer be framed: answer (requests) or fail the exchange (responses) and
// close the connection.
type Error struct {
	// Status is the HTTP status code to answer with: 400, 413, 417, 431, 501 or 505 for
	// request errors, 502 for errors in an upstream's response.
	Status int
	// Reason is a short lowercase phrase, fit for a client-facing error message.
	Reason string

	msg string
}

func newError(status int, reason string) *Error {
	return &Error{Status: status, Reason: reason, msg: "http1: " + reason}
}

// Error implements error. It returns a constant string and does not allocate.
func (e *Error) Error() string { return e.msg }

// StatusOf returns the HTTP status to answer for err: the Status of the first *Error in its
// chain, 500 for any other non-nil error, 200 for nil. It does not allocate.
func StatusOf(err error) int {
	for err != nil {
		if e, ok := err.(*Error); ok {
			return e.Status
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			break
		}
		err = u.Unwrap()
	}
	if err == nil {
		return 200
	}
	return 500
}

// Request errors (ParseRequest, ChunkedDecoder).
var (
	ErrHeadTooLarge         = newError(431, "request head too large")
	ErrTooManyHeaders       = newError(431, "too many header fields")
	ErrBodyTooLarge         = newError(413, "request body too large")
	ErrBadRequestLine       = newError(400, "malformed request line")
	ErrBadTarget            = newError(400, "invalid request target")
	ErrVersionNotSupported  = newError(505, "http version not supported")
	ErrMethodNotImplemented = newError(501, "method not implemented")
	ErrBadLineEnding        = newError(400, "bare cr or lf in message head")
	ErrBadHeaderName        = newError(400, "invalid header field name")
	ErrSpaceBeforeColon     = newError(400, "whitespace between header field name and colon")
	ErrBadHeaderValue       = newError(400, "invalid character in header field value")
	ErrObsFold              = newError(400, "obsolete header line folding")
	ErrBadContentLength     = newError(400, "invalid content-length")
	ErrContentLengthDiffer  = newError(400, "conflicting content-length values")
	ErrBadTransferEncoding  = newError(400, "invalid transfer-encoding")
	ErrUnsupportedEncoding  = newError(501, "transfer-encoding not implemented")
	ErrAmbiguousLength      = newError(400, "both content-length and transfer-encoding")
	ErrMissingHost          = newError(400, "missing host header")
	ErrBadHost              = newError(400, "invalid or repeated host header")
	ErrExpectation          = newError(417, "unsupported expectation")
	ErrBadChunk             = newError(400, "malformed chunked encoding")
	ErrTrailerTooLarge      = newError(431, "chunked trailer section too large")
)

// Response errors (ParseResponse, ChunkScanner): an upstream that sends these is answered
// with 502 Bad Gateway and its connection is not reused.
var (
	ErrResponseHeadTooLarge = newError(502, "upstream response head too large")
	ErrBadStatusLine        = newError(502, "malformed or unexpected upstream status line")
	ErrBadResponseHeader    = newError(502, "malformed upstream response header")
	ErrBadResponseFraming   = newError(502, "invalid upstream response framing")
	ErrBadResponseChunk     = newError(502, "malformed upstream chunked encoding")
	ErrResponseTooLarge     = newError(502, "upstream response body too large")
)

// code is the internal error of the shared scanners; errs maps it to the sentinel for each
// side. Keeping scanners on codes lets requests and responses share one implementation
// without passing tables or closures around.
type code uint8

const (
	cOK code = iota
	cHeadTooLarge
	cTooManyHeaders
	cBodyTooLarge
	cBadRequestLine
	cBadTarget
	cBadVersion
	cVersionNotSupported
	cMethodNotImplemented
	cBadLineEnding
	cBadHeaderName
	cSpaceBeforeColon
	cBadHeaderValue
	cObsFold
	cBadContentLength
	cContentLengthDiffer
	cBadTransferEncoding
	cUnsupportedEncoding
	cAmbiguousLength
	cMissingHost
	cBadHost
	cExpectation
	cBadChunk
	cTrailerTooLarge
	cBadStatusLine
	numCodes
)

var errs = [numCodes]struct{ req, resp *Error }{
	cHeadTooLarge:         {ErrHeadTooLarge, ErrResponseHeadTooLarge},
	cTooManyHeaders:       {ErrTooManyHeaders, ErrResponseHeadTooLarge},
	cBodyTooLarge:         {ErrBodyTooLarge, ErrResponseTooLarge},
	cBadRequestLine:       {ErrBadRequestLine, ErrBadStatusLine},
	cBadTarget:            {ErrBadTarget, ErrBadStatusLine},
	cBadVersion:           {ErrBadRequestLine, ErrBadStatusLine},
	cVersionNotSupported:  {ErrVersionNotSupported, ErrBadStatusLine},
	cMethodNotImplemented: {ErrMethodNotImplemented, ErrBadStatusLine},
	cBadLineEnding:        {ErrBadLineEnding, ErrBadResponseHeader},
	cBadHeaderName:        {ErrBadHeaderName, ErrBadResponseHeader},
	cSpaceBeforeColon:     {ErrSpaceBeforeColon, ErrBadResponseHeader},
	cBadHeaderValue:       {ErrBadHeaderValue, ErrBadResponseHeader},
	cObsFold:              {ErrObsFold, ErrBadResponseHeader},
	cBadContentLength:     {ErrBadContentLength, ErrBadResponseFraming},
	cContentLengthDiffer:  {ErrContentLengthDiffer, ErrBadResponseFraming},
	cBadTransferEncoding:  {ErrBadTransferEncoding, ErrBadResponseFraming},
	cUnsupportedEncoding:  {ErrUnsupportedEncoding, ErrBadResponseFraming},
	cAmbiguousLength:      {ErrAmbiguousLength, ErrBadResponseFraming},
	cMissingHost:          {ErrMissingHost, ErrBadResponseHeader},
	cBadHost:              {ErrBadHost, ErrBadResponseHeader},
	cExpectation:          {ErrExpectation, ErrBadResponseHeader},
	cBadChunk:             {ErrBadChunk, ErrBadResponseChunk},
	cTrailerTooLarge:      {ErrTrailerTooLarge, ErrBadResponseChunk},
	cBadStatusLine:        {ErrBadRequestLine, ErrBadStatusLine},
}

func (c code) req() error {
	if c == cOK {
		return nil
	}
	return errs[c].req
}

func (c code) resp() error {
	if c == cOK {
		return nil
	}
	return errs[c].resp
}
