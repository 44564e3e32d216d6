package client

import (
	"fmt"
	"time"

	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
)

// Dial returns a gRPC connection to the control plane at target (host:port) for a proxy's
// Client, Reporter and index journal to share. It connects lazily and reconnects by itself
// (exponential backoff from 100 ms to 5 s), pings an idle control plane every 15 s to find a
// dead one, and is plaintext: opts, applied last, may add transport credentials or override
// any of this. The caller closes it after the streams using it have stopped.
func Dial(target string, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	all := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:                15 * time.Second,
			Timeout:             5 * time.Second,
			PermitWithoutStream: true,
		}),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: grpcbackoff.Config{
				BaseDelay:  DefaultBackoffBase,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   DefaultBackoffMax,
			},
			MinConnectTimeout: 2 * time.Second,
		}),
	}, opts...)
	conn, err := grpc.NewClient(target, all...)
	if err != nil {
		return nil, fmt.Errorf("dialing control plane %s: %w", target, err)
	}
	return conn, nil
}
