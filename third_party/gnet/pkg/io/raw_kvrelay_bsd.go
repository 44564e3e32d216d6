// Copyright (c) 2026 the kvrelay authors
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//go:build darwin || dragonfly || freebsd || netbsd || openbsd

package io

import "golang.org/x/sys/unix"

// RawRead is unix.Read on BSD systems (raw_kvrelay_linux.go has the raw system call).
func RawRead(fd int, p []byte) (int, error) { return unix.Read(fd, p) }

// RawWrite is unix.Write on BSD systems.
func RawWrite(fd int, p []byte) (int, error) { return unix.Write(fd, p) }
