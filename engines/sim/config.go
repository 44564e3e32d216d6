package sim

import (
	"errors"
	"fmt"
)

// Role is what a worker does in a disaggregated deployment.
type Role string

// The roles of a worker: both phases (aggregated serving), or one phase of a disaggregated
// prefill/decode pair.
const (
	RoleBoth    Role = "both"
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// SchedulingPolicy orders the waiting queue.
type SchedulingPolicy string

// FCFS serves requests in arrival order; Priority serves lower `priority` values first (vLLM's
// convention), arrival order breaking ties, and preempts the least urgent request first.
const (
	FCFS     SchedulingPolicy = "fcfs"
	Priority SchedulingPolicy = "priority"
)

// Config describes one simulated worker. Field names follow vLLM's engine arguments.
type Config struct {
	Model               string
	BlockSize           int
	NumGPUBlocks        int
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	MaxModelLen         int
	EnablePrefixCaching bool
	SchedulingPolicy    SchedulingPolicy
	Role                Role
	Timing              Timing
	// EngineHashBytes makes the engine's own block hashes 32-byte strings instead of uint64s
	// (the --kv-block-hash bytes mode), as engines configured with a bytes hash report them.
	EngineHashBytes bool
	// MaxRequestBytes bounds a request body; larger bodies get 413.
	MaxRequestBytes int64
}

// DefaultConfig returns the defaults of `kvrelay sim`, which are vLLM's for a gpt-oss-120b
// server on one GPU.
func DefaultConfig() Config {
	return Config{
		Model:               "gpt-oss-120b",
		BlockSize:           16,
		NumGPUBlocks:        16384,
		MaxNumSeqs:          256,
		MaxNumBatchedTokens: 8192,
		MaxModelLen:         131072,
		EnablePrefixCaching: true,
		SchedulingPolicy:    FCFS,
		Role:                RoleBoth,
		Timing:              DefaultTiming(),
		MaxRequestBytes:     32 << 20,
	}
}

// ErrInvalidConfig is wrapped by every error Validate returns.
var ErrInvalidConfig = errors.New("invalid simulated engine config")

// Validate reports the first setting that cannot work.
func (c *Config) Validate() error {
	switch {
	case c.Model == "":
		return fmt.Errorf("%w: model is empty", ErrInvalidConfig)
	case c.BlockSize <= 0:
		return fmt.Errorf("%w: block size %d must be positive", ErrInvalidConfig, c.BlockSize)
	case c.NumGPUBlocks <= 0:
		return fmt.Errorf("%w: num gpu blocks %d must be positive", ErrInvalidConfig, c.NumGPUBlocks)
	case c.MaxNumSeqs <= 0:
		return fmt.Errorf("%w: max num seqs %d must be positive", ErrInvalidConfig, c.MaxNumSeqs)
	case c.MaxNumBatchedTokens <= 0:
		return fmt.Errorf("%w: max num batched tokens %d must be positive", ErrInvalidConfig, c.MaxNumBatchedTokens)
	case c.MaxModelLen <= 0:
		return fmt.Errorf("%w: max model len %d must be positive", ErrInvalidConfig, c.MaxModelLen)
	case c.Timing.Speedup <= 0:
		return fmt.Errorf("%w: speedup ratio %g must be positive", ErrInvalidConfig, c.Timing.Speedup)
	case c.MaxRequestBytes <= 0:
		return fmt.Errorf("%w: max request bytes %d must be positive", ErrInvalidConfig, c.MaxRequestBytes)
	}
	switch c.Role {
	case RoleBoth, RolePrefill, RoleDecode:
	default:
		return fmt.Errorf("%w: role %q is not both, prefill or decode", ErrInvalidConfig, c.Role)
	}
	switch c.SchedulingPolicy {
	case FCFS, Priority:
	default:
		return fmt.Errorf("%w: scheduling policy %q is not fcfs or priority", ErrInvalidConfig, c.SchedulingPolicy)
	}
	return nil
}
