package imex

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// Paths of the driver's files, relative to the host root, and of the
// channel device nodes.
const (
	procDevicesPath  = "proc/devices"
	driverParamsPath = "proc/driver/nvidia/params"
	// ChannelDir is where the driver's IMEX channel nodes are
	// (channel<N>, minor N), on the host and in containers.
	ChannelDir = "/dev/nvidia-caps-imex-channels"
	// channelDeviceName is the IMEX channels' character device in
	// /proc/devices.
	channelDeviceName = "nvidia-caps-imex-channels"
)

// maxProcFileBytes bounds what is read of /proc/devices and the driver's
// params: a few KB on any host.
const maxProcFileBytes = 64 << 10

// maxChannels bounds ImexChannelCount as read: the driver's minors are 20
// bits.
const maxChannels = 1 << 20

// Host is what the node's driver offers for IMEX: how many channels and the
// channel device's major.
type Host struct {
	Channels int
	Major    uint32
}

// ReadHost reads the driver's IMEX channel count
// (proc/driver/nvidia/params, ImexChannelCount) and the channel device's
// major (proc/devices) under root ("/" on a real node, the sim's root=).
func ReadHost(root string) (Host, error) {
	params, err := atomicfile.ReadFile(filepath.Join(root, driverParamsPath), maxProcFileBytes)
	if err != nil {
		return Host{}, fmt.Errorf("IMEX channel count: %w", err)
	}
	n, err := ParseChannelCount(params)
	if err != nil {
		return Host{}, fmt.Errorf("%s: %w", filepath.Join(root, driverParamsPath), err)
	}
	devices, err := atomicfile.ReadFile(filepath.Join(root, procDevicesPath), maxProcFileBytes)
	if err != nil {
		return Host{}, fmt.Errorf("IMEX channel major: %w", err)
	}
	major, err := ParseCharMajor(devices, channelDeviceName)
	if err != nil {
		return Host{}, fmt.Errorf("%s: %w", filepath.Join(root, procDevicesPath), err)
	}
	return Host{Channels: n, Major: major}, nil
}

// ParseChannelCount reads ImexChannelCount from the driver's params file
// ("Name: value" lines). A missing key, a value given twice or one out of
// range is an error naming it.
func ParseChannelCount(b []byte) (int, error) {
	if len(b) > maxProcFileBytes {
		return 0, fmt.Errorf("%d bytes: more than %d", len(b), maxProcFileBytes)
	}
	found, count := false, 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(key) != "ImexChannelCount" {
			continue
		}
		if found {
			return 0, errors.New("ImexChannelCount given twice")
		}
		n, err := strconv.Atoi(strings.TrimSpace(val))
		if err != nil || n < 0 || n > maxChannels {
			return 0, fmt.Errorf("ImexChannelCount %q: want 0 to %d", strings.TrimSpace(val), maxChannels)
		}
		found, count = true, n
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	if !found {
		return 0, errors.New("no ImexChannelCount (a driver older than IMEX channels)")
	}
	return count, nil
}

// ParseCharMajor reads the major of character device name from
// /proc/devices: "Character devices:" then "<major> <name>" lines, until
// "Block devices:". Names listed twice are an error.
func ParseCharMajor(b []byte, name string) (uint32, error) {
	if len(b) > maxProcFileBytes {
		return 0, fmt.Errorf("%d bytes: more than %d", len(b), maxProcFileBytes)
	}
	char, found := false, false
	var major uint32
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "Character devices:":
			char = true
			continue
		case strings.HasSuffix(line, "devices:"):
			char = false
			continue
		case !char:
			continue
		}
		num, dev, ok := strings.Cut(line, " ")
		if !ok || strings.TrimSpace(dev) != name {
			continue
		}
		if found {
			return 0, fmt.Errorf("%s listed twice", name)
		}
		m, err := strconv.ParseUint(num, 10, 12) // majors are 12 bits
		if err != nil {
			return 0, fmt.Errorf("%s: major %q: %w", name, num, err)
		}
		found, major = true, uint32(m)
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	if !found {
		return 0, fmt.Errorf("no character device %s (driver without IMEX channels)", name)
	}
	return major, nil
}
