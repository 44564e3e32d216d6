package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"math"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// ctlJSON renders an operator API message for `ctl -o json`: protobuf field names, every
// field (unset messages as null), enums by name, and 64-bit integers as JSON numbers, not
// the strings protojson writes, so that counters compare and add in jq and scripts.
func ctlJSON(m proto.Message) ([]byte, error) {
	return json.MarshalIndent(jsonMessage(m.ProtoReflect()), "", "  ")
}

// object keeps a message's fields in declaration order.
type object struct {
	keys []string
	vals []any
}

func (o object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		vb, err := json.Marshal(o.vals[i])
		if err != nil {
			return nil, err
		}
		b.Write(vb)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func jsonMessage(m protoreflect.Message) object {
	var o object
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if fd.ContainingOneof() != nil && !fd.ContainingOneof().IsSynthetic() && !m.Has(fd) {
			continue // an unset oneof member
		}
		o.keys = append(o.keys, string(fd.Name()))
		v := m.Get(fd)
		switch {
		case fd.IsList():
			l := v.List()
			arr := make([]any, 0, l.Len())
			for j := range l.Len() {
				arr = append(arr, jsonScalar(fd, l.Get(j)))
			}
			o.vals = append(o.vals, arr)
		case fd.IsMap():
			mm := map[string]any{}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				mm[k.String()] = jsonScalar(fd.MapValue(), mv)
				return true
			})
			o.vals = append(o.vals, mm)
		case fd.HasPresence() && !m.Has(fd) && (fd.Kind() == protoreflect.MessageKind || fd.ContainingOneof() != nil):
			o.vals = append(o.vals, nil) // an absent message or optional field: null, not a zero that would read as set
		default:
			o.vals = append(o.vals, jsonScalar(fd, v))
		}
	}
	return o
}

func jsonScalar(fd protoreflect.FieldDescriptor, v protoreflect.Value) any {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return jsonMessage(v.Message())
	case protoreflect.EnumKind:
		if ev := fd.Enum().Values().ByNumber(v.Enum()); ev != nil {
			return string(ev.Name())
		}
		return int32(v.Enum())
	case protoreflect.BytesKind:
		return base64.StdEncoding.EncodeToString(v.Bytes())
	case protoreflect.FloatKind, protoreflect.DoubleKind:
		f := v.Float()
		switch {
		case math.IsNaN(f):
			return "NaN"
		case math.IsInf(f, 1):
			return "Infinity"
		case math.IsInf(f, -1):
			return "-Infinity"
		}
		return f
	}
	return v.Interface()
}
