package sim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Role is what a worker does in a disaggregated deployment.
type Role string

// The roles of a worker: both phases (aggregated serving), or one phase of a disaggregated
// prefill/decode pair. A prefill or decode worker holds a KV connector (a nixl agent and a
// registered host-memory region with one slot per KV block) and speaks vLLM's NixlConnector
// protocol through kv_transfer_params; like vLLM's NixlConnector (kv_role "kv_both") it
// serves either leg, the role saying which pool it belongs to. A worker in role both has no
// connector and ignores kv_transfer_params, as vLLM does without a KV connector.
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

// Eviction is how the GPU tier chooses the cached block a new allocation evicts.
type Eviction string

// EvictLRU evicts the least recently freed block (vLLM's policy). EvictWORM evicts by class:
// ephemeral blocks (generated output a chat client re-renders rather than reads back) first,
// then by recency with reuse counting double, pinned blocks last.
const (
	EvictLRU  Eviction = "lru"
	EvictWORM Eviction = "worm"
)

// Offload is when a block is copied to the host tier.
type Offload string

// OffloadOnStore copies every block to host memory as it is stored (write-through, as vLLM's
// offloading connector does); OffloadOnEvict only when the GPU tier evicts it.
const (
	OffloadOnStore Offload = "store"
	OffloadOnEvict Offload = "evict"
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
	// Timing is the polynomial step-time model, and its Speedup scales every modelled
	// time; StepModel, when set, prices each step in its place (see Batch).
	Timing    Timing
	StepModel StepModel
	// EngineHashBytes makes the engine's own block hashes 32-byte strings instead of uint64s
	// (the --kv-block-hash bytes mode), as engines configured with a bytes hash report them.
	EngineHashBytes bool
	// OffloadPlaceholders publishes the host and disk tiers' stores as vLLM's offloading
	// connector does without self_describing_kv_events: the block's hash alone, no tokens,
	// block_size 0 (a subscriber places it only by a hash it saw with tokens on the GPU).
	// Off, every store carries its tokens and parent (self_describing_kv_events on).
	OffloadPlaceholders bool
	// MaxRequestBytes bounds a request body; larger bodies get 413.
	MaxRequestBytes int64
	// LoRAModules names the LoRA adapters served beside Model (vLLM's --lora-modules): a
	// request naming one as its model is answered by the base model, and its blocks are
	// keyed by the adapter's name, apart from the base model's.
	LoRAModules []string

	// KV block management below and within the GPU tier.

	// Eviction is how the GPU tier picks the cached block to evict (default EvictLRU).
	Eviction Eviction
	// LearnWriteOnce (under EvictWORM) makes the engine tell write-once output apart by
	// itself, without the client's hint: it watches whether later requests resend the blocks
	// it generated (a hit on one) or let them go unread, and while nearly none are resent
	// (writeOnceShare of those seen) it marks a request's generated blocks ephemeral, but for
	// one request in writeOnceProbe, which keeps the estimate honest.
	LearnWriteOnce bool
	// ReasoningTokens makes the engine a reasoning model behind vLLM's --reasoning-parser: the
	// first ReasoningTokens tokens a chat completion generates are its reasoning, answered
	// apart as reasoning_content, the rest as content (0: no reasoning). The chat templates
	// of reasoning models drop an earlier turn's reasoning from the next prompt, so the next
	// prompt departs from what this request generated at its first generated token: the
	// engine marks every block such a request generates write-once (ephemeral, under
	// EvictWORM), as the client's nvext.agent_hints.ephemeral_output would, from what its
	// own parser knows.
	ReasoningTokens int
	// MaxPinnedFraction caps the blocks pinned at once, as a share of NumGPUBlocks.
	MaxPinnedFraction float64
	// CPUOffloadBlocks is the host-memory tier's capacity in blocks (G2; 0: none).
	CPUOffloadBlocks int
	// DiskOffloadDir and DiskOffloadBlocks give the disk tier (G3): a directory holding a
	// file per block, and its capacity in blocks (either unset: none). DiskFsync syncs every
	// block file as it is written.
	DiskOffloadDir    string
	DiskOffloadBlocks int
	DiskFsync         bool
	// DiskShared makes DiskOffloadDir storage several workers mount (a directory on one
	// host standing for a shared volume): a block is there for every worker once any wrote
	// it, each worker evicts only the files it wrote (DiskOffloadBlocks of them), and the
	// tier is published as vLLM's fs tier on shared storage (STORAGE, locality REMOTE,
	// ownership SharedOwner), loaded at DiskBandwidth.
	DiskShared bool
	// OffloadOn is when blocks are copied to host (default OffloadOnStore).
	OffloadOn Offload
	// DiskAdmitMinHits is the reuses a block needs before it is written to disk.
	DiskAdmitMinHits int
	// HostBandwidth is the modelled host→GPU bandwidth of onboarding, bytes per second;
	// DiskBandwidth the floor of a disk block's onboarding (its real read time counts when
	// slower).
	HostBandwidth, DiskBandwidth float64

	// PeerFetch gives a worker of role both a KV connector too, for blocks any worker can
	// fetch: it exports its cached prefixes to peers (POST /kvrelay/kv/export) and, told to
	// by kv_transfer_params {"remote_kv_source": {...}} (vLLM's), pulls a prompt's
	// prefix from the holder instead of computing it, computing it after all when the pull
	// fails.
	PeerFetch bool

	// KV transfer (roles prefill and decode, or PeerFetch).

	// KVBytesPerToken is the size of one token's KV cache in the modelled model: it sets
	// the modelled transfer time of a pulled block (block size × this / bandwidth).
	KVBytesPerToken int
	// KVTransferBandwidth is the modelled prefill→decode bandwidth in bytes per second.
	KVTransferBandwidth float64
	// KVBytesScale scales KVBytesPerToken to the bytes really stored and moved per token,
	// so that loopback carries real data without exhausting the machine. A block slot is
	// max(1, round(BlockSize × KVBytesPerToken × KVBytesScale)) bytes.
	KVBytesScale float64
	// KVTransferTimeout is how long a prefill worker keeps a finished request's blocks for
	// the decode worker to pull before freeing them (vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT); it also bounds one pull on the decode side.
	KVTransferTimeout time.Duration
	// KVRegionMaxBytes caps the registered KV region. When NumGPUBlocks slots would not
	// fit, the region holds KVRegionMaxBytes/slot slots and block id b lives in slot
	// b mod slots (see the package README for what that costs).
	KVRegionMaxBytes int64
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
		// gpt-oss-120b in bf16: 36 layers × 8 KV heads × head dim 64 × (K, V) × 2 bytes.
		KVBytesPerToken:     36 * 8 * 64 * 2 * 2,
		KVTransferBandwidth: 50e9,
		KVBytesScale:        1.0 / 64,
		KVTransferTimeout:   30 * time.Second,
		KVRegionMaxBytes:    512 << 20,
		Eviction:            EvictLRU,
		MaxPinnedFraction:   0.5,
		OffloadOn:           OffloadOnStore,
		DiskAdmitMinHits:    2,
		HostBandwidth:       25e9, // PCIe 5 x16, host to device
		DiskBandwidth:       5e9,  // one NVMe drive
	}
}

// Tiers is what the worker advertises of its offloading tiers for routing: KV bytes per token,
// the host and disk bandwidths of the tiers it has and, with PeerFetch, the bandwidth it
// pulls peers' prefixes at (0 for what it lacks; all zero without any).
func (c *Config) Tiers() (kvBytesPerToken int, host, disk, peer float64) {
	if c.CPUOffloadBlocks > 0 {
		host = c.HostBandwidth
	}
	if c.DiskOffloadDir != "" && c.DiskOffloadBlocks > 0 && !c.DiskShared {
		disk = c.DiskBandwidth
	}
	if c.PeerFetch {
		peer = c.KVTransferBandwidth
	}
	if host == 0 && disk == 0 && peer == 0 && c.SharedTier() == 0 {
		return 0, 0, 0, 0
	}
	return c.KVBytesPerToken, host, disk, peer
}

// SharedTier is the bandwidth at which the engine loads blocks from storage it shares with
// other workers (its disk tier with DiskShared), 0 without one.
func (c *Config) SharedTier() float64 {
	if c.DiskOffloadDir != "" && c.DiskOffloadBlocks > 0 && c.DiskShared {
		return c.DiskBandwidth
	}
	return 0
}

// SlotBytes is the size of one KV block's slot in the transfer region: the bytes really
// stored and moved per block.
func (c *Config) SlotBytes() int {
	return max(1, int(math.Round(float64(c.BlockSize)*float64(c.KVBytesPerToken)*c.KVBytesScale)))
}

// RegionSlots is the number of block slots of the transfer region: one per KV block, or
// fewer when that would exceed KVRegionMaxBytes.
func (c *Config) RegionSlots() int {
	return int(min(int64(c.NumGPUBlocks), max(1, c.KVRegionMaxBytes/int64(c.SlotBytes()))))
}

// StagingSlots is the number of transfer-region slots after the RegionSlots of the GPU
// blocks through which a worker with PeerFetch gives peers the blocks its host or disk tier
// holds, without taking GPU blocks for them (NIXL reads a KV block manager's host tier, in
// pinned host memory, directly): as many as RegionSlots, none without PeerFetch or a tier
// below the GPU.
func (c *Config) StagingSlots() int {
	if !c.PeerFetch || (c.CPUOffloadBlocks <= 0 && c.DiskOffloadBlocks <= 0) {
		return 0
	}
	return c.RegionSlots()
}

// ModelledTransfer is the modelled wall time of moving n KV blocks from a prefill to a
// decode worker: n × block size × KVBytesPerToken at KVTransferBandwidth, divided by the
// timing speedup.
func (c *Config) ModelledTransfer(n int) time.Duration {
	if n <= 0 || c.KVTransferBandwidth <= 0 {
		return 0
	}
	s := c.Timing.Speedup
	if s <= 0 {
		s = 1
	}
	bytes := float64(n) * float64(c.BlockSize) * float64(c.KVBytesPerToken)
	return time.Duration(bytes / c.KVTransferBandwidth / s * float64(time.Second))
}

// ParseScale reads a KV bytes scale written as a fraction ("1/64") or a number
// ("0.015625"); it must lie in (0, 1].
func ParseScale(s string) (float64, error) {
	s = strings.TrimSpace(s)
	var v float64
	if num, den, ok := strings.Cut(s, "/"); ok {
		n, err1 := strconv.ParseFloat(strings.TrimSpace(num), 64)
		d, err2 := strconv.ParseFloat(strings.TrimSpace(den), 64)
		if err1 != nil || err2 != nil || d == 0 {
			return 0, fmt.Errorf("scale %q is not a fraction like 1/64", s)
		}
		v = n / d
	} else {
		var err error
		if v, err = strconv.ParseFloat(s, 64); err != nil {
			return 0, fmt.Errorf("scale %q is not a number or a fraction like 1/64", s)
		}
	}
	if !(v > 0 && v <= 1) {
		return 0, fmt.Errorf("scale %q must be in (0, 1]", s)
	}
	return v, nil
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
	case c.ReasoningTokens < 0:
		return fmt.Errorf("%w: reasoning tokens %d must not be negative", ErrInvalidConfig, c.ReasoningTokens)
	case c.Timing.Speedup <= 0:
		return fmt.Errorf("%w: speedup ratio %g must be positive", ErrInvalidConfig, c.Timing.Speedup)
	case c.Timing.PrefillAttention < 0 || c.Timing.DecodeAttention < 0:
		return fmt.Errorf("%w: attention costs (prefill %g, decode %g ms per 1000 tokens) must not be negative", ErrInvalidConfig, c.Timing.PrefillAttention, c.Timing.DecodeAttention)
	case c.MaxRequestBytes <= 0:
		return fmt.Errorf("%w: max request bytes %d must be positive", ErrInvalidConfig, c.MaxRequestBytes)
	}
	for i, name := range c.LoRAModules {
		switch {
		case name == "" || name == c.Model:
			return fmt.Errorf("%w: LoRA adapter name %q must be non-empty and differ from the model", ErrInvalidConfig, name)
		case slices.Contains(c.LoRAModules[:i], name):
			return fmt.Errorf("%w: LoRA adapter %q given twice", ErrInvalidConfig, name)
		}
	}
	switch c.Eviction {
	case "", EvictLRU, EvictWORM:
	default:
		return fmt.Errorf("%w: eviction %q is not lru or worm", ErrInvalidConfig, c.Eviction)
	}
	switch c.OffloadOn {
	case "", OffloadOnStore, OffloadOnEvict:
	default:
		return fmt.Errorf("%w: offload on %q is not store or evict", ErrInvalidConfig, c.OffloadOn)
	}
	switch {
	case !(c.MaxPinnedFraction >= 0 && c.MaxPinnedFraction <= 1):
		return fmt.Errorf("%w: max pinned fraction %g must be in [0, 1]", ErrInvalidConfig, c.MaxPinnedFraction)
	case c.CPUOffloadBlocks < 0 || c.DiskOffloadBlocks < 0:
		return fmt.Errorf("%w: offload tier capacities must not be negative", ErrInvalidConfig)
	case (c.DiskOffloadDir == "") != (c.DiskOffloadBlocks == 0):
		return fmt.Errorf("%w: a disk tier needs both a directory and a capacity in blocks", ErrInvalidConfig)
	case c.DiskAdmitMinHits < 0:
		return fmt.Errorf("%w: disk admit min hits %d must not be negative", ErrInvalidConfig, c.DiskAdmitMinHits)
	case (c.CPUOffloadBlocks > 0 || c.DiskOffloadBlocks > 0) && c.KVBytesPerToken <= 0:
		return fmt.Errorf("%w: offload tiers need kv bytes per token to price onboarding", ErrInvalidConfig)
	case c.HostBandwidth < 0 || c.DiskBandwidth < 0 || math.IsInf(c.HostBandwidth, 0) || math.IsInf(c.DiskBandwidth, 0) || math.IsNaN(c.HostBandwidth) || math.IsNaN(c.DiskBandwidth):
		return fmt.Errorf("%w: host and disk bandwidths must be finite and not negative", ErrInvalidConfig)
	}
	switch {
	case c.Role == RoleBoth && !c.PeerFetch:
		// No KV connector: the transfer settings are unused.
	case c.KVBytesPerToken <= 0:
		return fmt.Errorf("%w: kv bytes per token %d must be positive", ErrInvalidConfig, c.KVBytesPerToken)
	case !(c.KVTransferBandwidth > 0) || math.IsInf(c.KVTransferBandwidth, 0):
		return fmt.Errorf("%w: kv transfer bandwidth %g must be positive", ErrInvalidConfig, c.KVTransferBandwidth)
	case !(c.KVBytesScale > 0 && c.KVBytesScale <= 1):
		return fmt.Errorf("%w: kv bytes scale %g must be in (0, 1]", ErrInvalidConfig, c.KVBytesScale)
	case c.KVTransferTimeout <= 0:
		return fmt.Errorf("%w: kv transfer timeout %v must be positive", ErrInvalidConfig, c.KVTransferTimeout)
	case c.KVRegionMaxBytes <= 0:
		return fmt.Errorf("%w: kv region max bytes %d must be positive", ErrInvalidConfig, c.KVRegionMaxBytes)
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
