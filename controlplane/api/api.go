package api

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// Backend is what the operator API serves: the control plane's registry, load view, policy
// store, index and xDS server behind one method per operation (Drain and Undrain share
// SetDraining).
//
// Its methods are called concurrently, from the goroutines of gRPC and HTTP requests, with
// the request's context. Arguments have been checked for presence (a non-empty id, a
// non-nil spec or policy, a spec's Source and a policy's Version cleared); everything else
// (URLs, roles, weights) is the Backend's to validate. Arguments are the Backend's to keep;
// returned messages are not modified by this package afterwards, only marshalled.
//
// Errors should wrap ErrNotFound (no worker has the id), ErrInvalid (a malformed spec or
// policy) or ErrConflict (the operation cannot apply to the current state, such as removing
// a worker that only its file or Kubernetes can remove); their text reaches the client.
// Other errors are reported as internal errors.
type Backend interface {
	ListWorkers(ctx context.Context) ([]*operatorv1.Worker, error)
	GetWorker(ctx context.Context, id string) (*operatorv1.Worker, error)
	// UpsertWorker adds the worker or replaces the spec of the one with its id.
	UpsertWorker(ctx context.Context, spec *operatorv1.WorkerSpec) (*operatorv1.Worker, error)
	RemoveWorker(ctx context.Context, id string) error
	// SetDraining drains (true) or undrains (false) a worker and returns it.
	SetDraining(ctx context.Context, id string, draining bool) (*operatorv1.Worker, error)
	GetPolicy(ctx context.Context) (*operatorv1.Policy, error)
	// SetPolicy replaces the routing policy and returns the stored one with its new version.
	SetPolicy(ctx context.Context, p *operatorv1.Policy) (*operatorv1.Policy, error)
	GetIndex(ctx context.Context) (*operatorv1.Index, error)
	ListProxies(ctx context.Context) ([]*operatorv1.Proxy, error)
	// ListTenants returns the tenants with budgets the proxies report, sorted by name.
	ListTenants(ctx context.Context) ([]*operatorv1.Tenant, error)
	// ListAPIKeys returns the API keys given to proxies, sorted by id, without the keys
	// themselves; PutAPIKey stores one (by its id, its key turned into its SHA-256) and
	// returns it as stored; DeleteAPIKey deletes one (ErrNotFound when there is none).
	ListAPIKeys(ctx context.Context) ([]*operatorv1.ApiKey, error)
	PutAPIKey(ctx context.Context, k *operatorv1.ApiKey) (*operatorv1.ApiKey, error)
	DeleteAPIKey(ctx context.Context, id string) error
	// StartRollout starts a rollout of the candidate (its version cleared) as spec says
	// (ErrConflict while one runs); GetRollout returns the running or latest rollout
	// (ErrNotFound when none ever ran); ControlRollout applies one of RolloutActions.
	StartRollout(ctx context.Context, candidate *operatorv1.Policy, spec *operatorv1.RolloutSpec) (*operatorv1.Rollout, error)
	GetRollout(ctx context.Context) (*operatorv1.Rollout, error)
	ControlRollout(ctx context.Context, action string) (*operatorv1.Rollout, error)
	// PolicyHistory returns at most limit (> 0) changes of the policy, the latest first.
	PolicyHistory(ctx context.Context, limit int) ([]*operatorv1.PolicyChange, error)
}

// RolloutActions are the actions ControlRollout takes.
var RolloutActions = []string{"pause", "resume", "promote", "abort"}

// DefaultHistoryLimit is the number of policy changes PolicyHistory returns when the request
// names none; MaxHistoryLimit the most it returns.
const (
	DefaultHistoryLimit = 50
	MaxHistoryLimit     = 1000
)

// Errors a Backend wraps so that clients get the right status; test with errors.Is.
var (
	// ErrNotFound: no such worker. gRPC NotFound, HTTP 404.
	ErrNotFound = errors.New("not found")
	// ErrInvalid: a malformed request. gRPC InvalidArgument, HTTP 400.
	ErrInvalid = errors.New("invalid")
	// ErrConflict: the request does not apply to the current state. gRPC
	// FailedPrecondition, HTTP 409.
	ErrConflict = errors.New("conflict")
)

// MaxBodyBytes limits the body of an HTTP request.
const MaxBodyBytes = 1 << 20

// Options configure authentication, for the gRPC service and the HTTP handler alike.
type Options struct {
	// Token is the bearer token that calls changing state need (and reads, unless
	// OpenReads). Empty: no token is configured. TokenFunc, when set, is asked instead at
	// each call (a token that rotates: a re-read Secret).
	Token     string
	TokenFunc func() string
	// OpenReads serves reads without a token; the control plane sets it when the API listens
	// on loopback only.
	OpenReads bool
	// AllowUnauthenticated serves every call without a token when Token is empty; without
	// it, an API with no token refuses what would need one. For tests and trusted sandboxes.
	AllowUnauthenticated bool
	// OnReject, when set, hears of every call refused for its credentials, with the reason
	// ("unauthenticated" for a missing or wrong token, "no_token" when none is configured).
	OnReject func(reason string, r *http.Request)
	// Leader, when set, is asked before each authorized call that changes state: a replica
	// that does not lead answers its error (wrapping leader.ErrNotLeader, naming the
	// leader) as gRPC Unavailable, HTTP 503, and OnReject hears "not_leader". Unset: this
	// replica makes every change.
	Leader func() error
}

// errNoToken is the refusal of an API started without a token.
const errNoToken = "the operator API has no token configured, so it refuses this call: start the control plane with --api-token-file"

// authorizer checks bearer tokens in constant time.
type authorizer struct {
	opts Options
	sum  [sha256.Size]byte
}

func newAuthorizer(opts Options) authorizer {
	return authorizer{opts: opts, sum: sha256.Sum256([]byte(opts.Token))}
}

// token is the token in force and its digest.
func (a *authorizer) token() (string, [sha256.Size]byte) {
	if a.opts.TokenFunc != nil {
		t := a.opts.TokenFunc()
		return t, sha256.Sum256([]byte(t))
	}
	return a.opts.Token, a.sum
}

// check authorizes a call given its Authorization value (possibly empty). It returns nil or
// an *Error with code Unauthenticated or PermissionDenied.
func (a *authorizer) check(authorization string, mutating bool) *Error {
	if !mutating && a.opts.OpenReads {
		return nil
	}
	token, want := a.token()
	if token == "" {
		if a.opts.AllowUnauthenticated {
			return a.lead(mutating)
		}
		return &Error{Code: codes.PermissionDenied, Message: errNoToken}
	}
	scheme, tok, ok := strings.Cut(strings.TrimSpace(authorization), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return &Error{Code: codes.Unauthenticated, Message: "missing bearer token: send Authorization: Bearer <token> (kvrelay ctl: --token-file or KVRELAY_API_TOKEN)"}
	}
	// Comparing digests keeps the comparison constant-time whatever the lengths.
	sum := sha256.Sum256([]byte(strings.TrimSpace(tok)))
	if subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
		return &Error{Code: codes.Unauthenticated, Message: "invalid bearer token"}
	}
	return a.lead(mutating)
}

// lead refuses a change on a replica that does not lead. It comes after the token check:
// who leads is not told to callers without credentials.
func (a *authorizer) lead(mutating bool) *Error {
	if !mutating || a.opts.Leader == nil {
		return nil
	}
	if err := a.opts.Leader(); err != nil {
		return &Error{Code: codes.Unavailable, Message: err.Error()}
	}
	return nil
}

// rejectReason is OnReject's reason for a refusal by check.
func rejectReason(e *Error) string {
	switch e.Code {
	case codes.Unauthenticated:
		return "unauthenticated"
	case codes.Unavailable:
		return "not_leader"
	}
	return "no_token"
}

// Error is an API error with its gRPC code; it is what clients of both transports see.
type Error struct {
	Code    codes.Code
	Message string
}

func (e *Error) Error() string { return e.Message }

// GRPCStatus makes an *Error a gRPC status error.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// HTTPStatus is the HTTP status for the error's code.
func (e *Error) HTTPStatus() int {
	switch e.Code {
	case codes.InvalidArgument, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.NotFound:
		return http.StatusNotFound
	case codes.FailedPrecondition, codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.ResourceExhausted:
		return http.StatusRequestEntityTooLarge
	case codes.Unimplemented:
		return http.StatusMethodNotAllowed
	case codes.Canceled:
		return 499 // client closed request, as nginx and grpc-gateway write it
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// codeNames are the "code" strings of HTTP error bodies.
var codeNames = map[codes.Code]string{
	codes.InvalidArgument:    "invalid_argument",
	codes.OutOfRange:         "out_of_range",
	codes.Unauthenticated:    "unauthenticated",
	codes.PermissionDenied:   "permission_denied",
	codes.NotFound:           "not_found",
	codes.FailedPrecondition: "failed_precondition",
	codes.AlreadyExists:      "already_exists",
	codes.Aborted:            "aborted",
	codes.ResourceExhausted:  "request_too_large",
	codes.Unimplemented:      "method_not_allowed",
	codes.Canceled:           "canceled",
	codes.DeadlineExceeded:   "deadline_exceeded",
	codes.Unavailable:        "unavailable",
}

// CodeName is the "code" of an HTTP error body for c.
func CodeName(c codes.Code) string {
	if n, ok := codeNames[c]; ok {
		return n
	}
	return "internal"
}

// toError maps an error from a Backend (or from this package) to an *Error.
func toError(err error) *Error {
	var e *Error
	switch {
	case errors.As(err, &e):
		return e
	case errors.Is(err, ErrNotFound):
		return &Error{Code: codes.NotFound, Message: err.Error()}
	case errors.Is(err, ErrInvalid):
		return &Error{Code: codes.InvalidArgument, Message: err.Error()}
	case errors.Is(err, ErrConflict):
		return &Error{Code: codes.FailedPrecondition, Message: err.Error()}
	case errors.Is(err, context.Canceled):
		return &Error{Code: codes.Canceled, Message: err.Error()}
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Code: codes.DeadlineExceeded, Message: err.Error()}
	}
	if s, ok := status.FromError(err); ok && s.Code() != codes.Unknown {
		return &Error{Code: s.Code(), Message: s.Message()}
	}
	return &Error{Code: codes.Internal, Message: err.Error()}
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}
