package server

import (
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
)

// Encoded is a message that carries its own wire encoding. The xDS port's codec sends those
// bytes as they are, shared by every stream that sends the message, instead of marshaling a
// copy per stream: the index journal encodes a snapshot once for all the proxies resyncing
// from it. The bytes must be the protobuf encoding of the message and must not be modified.
type Encoded interface {
	EncodedProto() []byte
}

// codec is protobuf's gRPC codec, but for Encoded messages.
type codec struct{ proto encoding.CodecV2 }

func newCodec() codec { return codec{proto: encoding.GetCodecV2(proto.Name)} }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if e, ok := v.(Encoded); ok {
		return mem.BufferSlice{mem.SliceBuffer(e.EncodedProto())}, nil
	}
	return c.proto.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

func (c codec) Name() string { return c.proto.Name() }

var _ encoding.CodecV2 = codec{}
