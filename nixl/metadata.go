package nixl

import (
	"encoding/binary"
	"fmt"
	"math"
)

// BackendInfo is one backend's entry in an agent's metadata: its kind and the opaque
// connection info a peer's backend of the same kind needs (for TCP "host:port").
type BackendInfo struct {
	Kind BackendKind
	Info []byte
}

// Metadata is what an agent publishes about itself so that peers can address it: its
// name, the backends it speaks with their connection info, and the regions peers may
// read and write. Agent.GetLocalMD encodes it; Agent.LoadRemoteMD decodes and loads it.
type Metadata struct {
	Name string
	// Instance identifies one run of the agent (random at NewAgent). Connections check
	// it, so metadata of a previous run is never used against a restarted peer.
	Instance uint64
	Backends []BackendInfo
	Regions  []RegionDesc
}

// Backend returns the info of the named backend and whether the agent speaks it.
func (m *Metadata) Backend(kind BackendKind) ([]byte, bool) {
	for _, b := range m.Backends {
		if b.Kind == kind {
			return b.Info, true
		}
	}
	return nil, false
}

// Metadata encoding, little-endian:
//
//	magic "NXMD" | version u8
//	name      u16 len, bytes
//	instance  u64
//	backends  u8 count, each: kind (u16 len, bytes), info (u32 len, bytes)
//	regions   u32 count, each: id u32, mem u8, flags u8, dev u32, addr u64, len u64,
//	          name (u16 len, bytes)
//
// Nothing may follow the last region.
const (
	mdMagic          = "NXMD"
	mdVersion        = 1
	mdMaxName        = 1024
	mdMaxKind        = 64
	mdMaxInfo        = 64 << 10
	mdRegionFixed    = 4 + 1 + 1 + 4 + 8 + 8 + 2
	mdFlagShared     = 1 << 0
	mdKnownFlags     = mdFlagShared
	maxMetadataBytes = 64 << 20 // bound on a metadata blob accepted from the wire
)

// MarshalBinary encodes the metadata.
func (m *Metadata) MarshalBinary() ([]byte, error) {
	if m.Name == "" || len(m.Name) > mdMaxName {
		return nil, fmt.Errorf("encoding metadata: agent name length %d: %w", len(m.Name), ErrBadMetadata)
	}
	if len(m.Backends) > math.MaxUint8 {
		return nil, fmt.Errorf("encoding metadata: %d backends: %w", len(m.Backends), ErrBadMetadata)
	}
	n := len(mdMagic) + 1 + 2 + len(m.Name) + 8 + 1 + 4
	for _, b := range m.Backends {
		if len(b.Kind) == 0 || len(b.Kind) > mdMaxKind || len(b.Info) > mdMaxInfo {
			return nil, fmt.Errorf("encoding metadata: backend %q: %w", b.Kind, ErrBadMetadata)
		}
		n += 2 + len(b.Kind) + 4 + len(b.Info)
	}
	for _, r := range m.Regions {
		if len(r.Name) > mdMaxName {
			return nil, fmt.Errorf("encoding metadata: region %d name: %w", r.ID, ErrBadMetadata)
		}
		n += mdRegionFixed + len(r.Name)
	}
	b := make([]byte, 0, n)
	b = append(b, mdMagic...)
	b = append(b, mdVersion)
	b = appendStr16(b, m.Name)
	b = binary.LittleEndian.AppendUint64(b, m.Instance)
	b = append(b, byte(len(m.Backends)))
	for _, be := range m.Backends {
		b = appendStr16(b, string(be.Kind))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(be.Info)))
		b = append(b, be.Info...)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(m.Regions)))
	for _, r := range m.Regions {
		b = binary.LittleEndian.AppendUint32(b, r.ID)
		b = append(b, byte(r.Mem))
		var flags byte
		if r.Shared {
			flags |= mdFlagShared
		}
		b = append(b, flags)
		b = binary.LittleEndian.AppendUint32(b, r.DevID)
		b = binary.LittleEndian.AppendUint64(b, r.Addr)
		b = binary.LittleEndian.AppendUint64(b, r.Len)
		b = appendStr16(b, r.Name)
	}
	return b, nil
}

// DecodeMetadata decodes and validates metadata produced by MarshalBinary. It never
// panics, whatever the input; malformed input yields an error wrapping ErrBadMetadata.
func DecodeMetadata(data []byte) (*Metadata, error) {
	m := new(Metadata)
	if err := m.UnmarshalBinary(data); err != nil {
		return nil, err
	}
	return m, nil
}

// UnmarshalBinary decodes metadata into m; see DecodeMetadata.
func (m *Metadata) UnmarshalBinary(data []byte) error {
	d := decoder{b: data}
	if len(data) > maxMetadataBytes {
		return fmt.Errorf("decoding metadata: %d bytes: %w", len(data), ErrBadMetadata)
	}
	if string(d.bytes(len(mdMagic))) != mdMagic {
		return fmt.Errorf("decoding metadata: bad magic: %w", ErrBadMetadata)
	}
	if v := d.u8(); v != mdVersion {
		return fmt.Errorf("decoding metadata: version %d: %w", v, ErrBadMetadata)
	}
	name := d.str16(mdMaxName)
	if d.err == nil && name == "" {
		return fmt.Errorf("decoding metadata: empty agent name: %w", ErrBadMetadata)
	}
	instance := d.u64()
	nb := int(d.u8())
	backends := make([]BackendInfo, 0, min(nb, 8))
	for i := 0; i < nb && d.err == nil; i++ {
		kind := d.str16(mdMaxKind)
		n := d.u32()
		if n > mdMaxInfo {
			d.fail()
		}
		info := d.bytes(int(n))
		if d.err != nil {
			break
		}
		if kind == "" {
			return fmt.Errorf("decoding metadata: empty backend kind: %w", ErrBadMetadata)
		}
		backends = append(backends, BackendInfo{Kind: BackendKind(kind), Info: append([]byte(nil), info...)})
	}
	nr := d.u32()
	if d.err == nil && uint64(nr)*mdRegionFixed > uint64(d.left()) {
		return fmt.Errorf("decoding metadata: %d regions in %d bytes: %w", nr, d.left(), ErrBadMetadata)
	}
	var regions []RegionDesc
	if d.err == nil {
		regions = make([]RegionDesc, 0, nr)
	}
	ids := make(map[uint32]struct{}, min(int(nr), 1024))
	for i := uint32(0); i < nr && d.err == nil; i++ {
		r := RegionDesc{ID: d.u32(), Mem: MemType(d.u8())}
		flags := d.u8()
		r.DevID = d.u32()
		r.Addr = d.u64()
		r.Len = d.u64()
		r.Name = d.str16(mdMaxName)
		if d.err != nil {
			break
		}
		r.Shared = flags&mdFlagShared != 0
		switch {
		case r.Mem != DRAM && r.Mem != VRAM:
			return fmt.Errorf("decoding metadata: region %d memory type %d: %w", r.ID, r.Mem, ErrBadMetadata)
		case flags&^mdKnownFlags != 0:
			return fmt.Errorf("decoding metadata: region %d flags %#x: %w", r.ID, flags, ErrBadMetadata)
		case checkDesc(r.Whole()) != nil:
			return fmt.Errorf("decoding metadata: region %d range: %w", r.ID, ErrBadMetadata)
		}
		if _, dup := ids[r.ID]; dup {
			return fmt.Errorf("decoding metadata: duplicate region id %d: %w", r.ID, ErrBadMetadata)
		}
		ids[r.ID] = struct{}{}
		regions = append(regions, r)
	}
	if d.err != nil {
		return fmt.Errorf("decoding metadata: truncated or oversized field: %w", ErrBadMetadata)
	}
	if d.left() != 0 {
		return fmt.Errorf("decoding metadata: %d trailing bytes: %w", d.left(), ErrBadMetadata)
	}
	sorted := append([]RegionDesc(nil), regions...)
	sortRegions(sorted)
	for i := 1; i < len(sorted); i++ {
		p, c := &sorted[i-1], &sorted[i]
		if p.Mem == c.Mem && p.DevID == c.DevID && c.Addr < p.Addr+p.Len {
			return fmt.Errorf("decoding metadata: regions %d and %d overlap: %w", p.ID, c.ID, ErrBadMetadata)
		}
	}
	*m = Metadata{Name: name, Instance: instance, Backends: backends, Regions: regions}
	return nil
}

func appendStr16(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

// decoder reads little-endian fields from a byte slice; after the first short read every
// accessor returns zero values and err stays set.
type decoder struct {
	b   []byte
	off int
	err error
}

func (d *decoder) fail() {
	if d.err == nil {
		d.err = ErrBadMetadata
	}
}

func (d *decoder) left() int { return len(d.b) - d.off }

func (d *decoder) bytes(n int) []byte {
	if d.err != nil || n < 0 || n > d.left() {
		d.fail()
		return nil
	}
	p := d.b[d.off : d.off+n : d.off+n]
	d.off += n
	return p
}

func (d *decoder) u8() uint8 {
	p := d.bytes(1)
	if p == nil {
		return 0
	}
	return p[0]
}

func (d *decoder) u16() uint16 {
	p := d.bytes(2)
	if p == nil {
		return 0
	}
	return binary.LittleEndian.Uint16(p)
}

func (d *decoder) u32() uint32 {
	p := d.bytes(4)
	if p == nil {
		return 0
	}
	return binary.LittleEndian.Uint32(p)
}

func (d *decoder) u64() uint64 {
	p := d.bytes(8)
	if p == nil {
		return 0
	}
	return binary.LittleEndian.Uint64(p)
}

func (d *decoder) str16(max int) string {
	n := int(d.u16())
	if n > max {
		d.fail()
		return ""
	}
	return string(d.bytes(n))
}
