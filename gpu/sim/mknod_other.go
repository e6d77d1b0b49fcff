//go:build !unix

package sim

import "errors"

func mknodChar(string, uint32, uint32) error { return errors.ErrUnsupported }
