//go:build !unix

package tenant

import "os"

// fileID is 0, 0 where os.FileInfo carries no inode: the resolved path and the size and
// modification time tell a changed file alone.
func fileID(os.FileInfo) (dev, ino uint64) { return 0, 0 }
