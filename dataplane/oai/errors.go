package oai

import (
	"errors"
	"strconv"
	"unicode/utf8"
)

// Sentinel errors. Every error Parse returns is an *Error that wraps one of them, so callers
// branch with errors.Is and reach the client-facing fields with errors.As.
var (
	// ErrInvalidJSON: the body is not JSON that Python's json.loads would accept (the engine
	// would answer 400 before looking at any field).
	ErrInvalidJSON = errors.New("invalid JSON")
	// ErrInvalidRequest: the body is JSON but a field is missing, has the wrong type or is out
	// of range.
	ErrInvalidRequest = errors.New("invalid request")
)

// OpenAI error codes carried in Error.Code.
const (
	CodeInvalidJSON      = "invalid_json"
	CodeInvalidType      = "invalid_type"
	CodeMissingParameter = "missing_required_parameter"
	CodeEmptyArray       = "empty_array"
	CodeBelowMinimum     = "integer_below_min_value"
	CodeInvalidValue     = "invalid_value"
)

// Error is a request the proxy must refuse with HTTP 400 and an OpenAI error body. It is
// built only on the failure path; Parse allocates one per rejected request.
type Error struct {
	Kind    error  // ErrInvalidJSON or ErrInvalidRequest
	Param   string // the OpenAI parameter, e.g. "messages[2].content"; empty for syntax errors
	Message string // client-facing, e.g. "messages must be a non-empty array"
	Code    string // an OpenAI error code (Code* constants)
	Offset  int    // byte offset of a syntax error in the body; -1 for field errors
}

// Error returns the message prefixed with what was being done, for logs.
func (e *Error) Error() string { return "parse openai request: " + e.Message }

// Unwrap returns the sentinel, ErrInvalidJSON or ErrInvalidRequest.
func (e *Error) Unwrap() error { return e.Kind }

// Status is the HTTP status to answer with.
func (e *Error) Status() int { return 400 }

// Type is the OpenAI error type.
func (e *Error) Type() string { return "invalid_request_error" }

// AppendJSON appends the OpenAI error body
// {"error":{"message":…,"type":"invalid_request_error","param":…,"code":…}}.
func (e *Error) AppendJSON(dst []byte) []byte {
	dst = append(dst, `{"error":{"message":`...)
	dst = appendJSONString(dst, e.Message)
	dst = append(dst, `,"type":"invalid_request_error","param":`...)
	if e.Param == "" {
		dst = append(dst, "null"...)
	} else {
		dst = appendJSONString(dst, e.Param)
	}
	dst = append(dst, `,"code":`...)
	if e.Code == "" {
		dst = append(dst, "null"...)
	} else {
		dst = appendJSONString(dst, e.Code)
	}
	return append(dst, "}}"...)
}

func syntaxError(off int, reason string) *Error {
	return &Error{
		Kind:    ErrInvalidJSON,
		Message: "invalid JSON body: " + reason + " at byte " + strconv.Itoa(off),
		Code:    CodeInvalidJSON,
		Offset:  off,
	}
}

func fieldError(param, msg, code string) *Error {
	return &Error{Kind: ErrInvalidRequest, Param: param, Message: msg, Code: code, Offset: -1}
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string, escaping what JSON requires (and <, >, & are
// left alone: the output is an API body, not HTML).
func appendJSONString[S ~string | ~[]byte](dst []byte, s S) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, n := utf8.DecodeRuneInString(string(s[i:min(i+utf8.UTFMax, len(s))]))
			if r != utf8.RuneError || n > 1 {
				i += n
				continue
			}
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		default:
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		}
		i++
		start = i
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
