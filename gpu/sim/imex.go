package sim

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// DefaultIMEXChannelCount is the NVIDIA driver's default for its
// NVreg_ImexChannelCount module parameter: how many IMEX channels (minors
// of the nvidia-caps-imex-channels character device) it offers.
const DefaultIMEXChannelCount = 2048

// MaxIMEXChannelCount bounds WithIMEXChannels: minors are 20 bits, and a
// simulated node makes one device node per channel.
const MaxIMEXChannelCount = 1 << 20

// The character device majors the sim's driver files give: the IMEX
// channels' is the IMEX guide's example (234); a real node's differ from
// boot to boot, so readers must take them from proc/devices.
const (
	imexChannelsMajor = 234
	nvidiaCapsMajor   = 235
	// fabricIMEXMgmtMinor is the minor of the nvidia-caps node that
	// grants IMEX daemons access to the fabric (the capability
	// fabric-imex-mgmt).
	fabricIMEXMgmtMinor = 512
)

// Paths of the driver files WriteDriverFiles makes, relative to a root.
const (
	ProcDevicesPath       = "proc/devices"
	DriverParamsPath      = "proc/driver/nvidia/params"
	FabricIMEXMgmtCapPath = "proc/driver/nvidia/capabilities/fabric-imex-mgmt"
	IMEXChannelsDir       = "dev/nvidia-caps-imex-channels"
)

// WithIMEXChannels sets how many IMEX channels the node's driver offers
// (NVreg_ImexChannelCount; default DefaultIMEXChannelCount), which
// WriteDriverFiles writes.
func WithIMEXChannels(count int) Option { return func(o *options) { o.imexChannels = count } }

// IMEXChannelCount is the number of IMEX channels the driver offers.
func (n *Node) IMEXChannelCount() int { return n.opts.imexChannels }

// WriteDriverFiles writes under root the files by which the NVIDIA driver
// tells user space about IMEX, so code that reads them runs on a
// simulated node as on a real one:
//   - proc/devices, with the nvidia-caps and nvidia-caps-imex-channels
//     character device majors, in /proc/devices' format;
//   - proc/driver/nvidia/params, with ImexChannelCount;
//   - on fabric-attached profiles, proc/driver/nvidia/capabilities/fabric-imex-mgmt,
//     the capability IMEX daemons need (DeviceFileMinor);
//   - dev/nvidia-caps-imex-channels/channel<N> for every channel, character
//     devices of the IMEX major and minor N, mode 0666. The driver itself
//     makes none (an administrator or NVreg_CreateImexChannel0 does); the
//     sim stands for a host set up with all of them. Making device nodes
//     needs CAP_MKNOD; without it the nodes are left out and the error
//     says so, the proc files are written all the same.
//
// Files are replaced atomically; channel nodes already there are kept,
// and ones past the count removed, so it can run at every start.
func (n *Node) WriteDriverFiles(root string) error {
	devices := fmt.Sprintf("Character devices:\n  1 mem\n195 nvidia\n195 nvidiactl\n%d nvidia-caps-imex-channels\n%d nvidia-caps\n\nBlock devices:\n  7 loop\n",
		imexChannelsMajor, nvidiaCapsMajor)
	params := fmt.Sprintf("ModifyDeviceFiles: 1\nImexChannelCount: %d\nCreateImexChannel0: 0\n", n.opts.imexChannels)
	files := map[string]string{ProcDevicesPath: devices, DriverParamsPath: params}
	if n.spec.fabric {
		files[FabricIMEXMgmtCapPath] = fmt.Sprintf("DeviceFileMinor: %d\nDeviceFileMode: 256\nDeviceFileModify: 1\n", fabricIMEXMgmtMinor)
	}
	for rel, content := range files {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("sim %s: driver files: %w", n.spec.name, err)
		}
		if err := atomicfile.Write(p, []byte(content)); err != nil {
			return fmt.Errorf("sim %s: driver file %s: %w", n.spec.name, p, err)
		}
	}
	if err := writeIMEXChannels(filepath.Join(root, IMEXChannelsDir), n.opts.imexChannels); err != nil {
		return fmt.Errorf("sim %s: IMEX channel devices: %w", n.spec.name, err)
	}
	return nil
}

// writeIMEXChannels makes channel0 .. channel<count-1> in dir and removes
// higher ones a larger count left.
func writeIMEXChannels(dir string, count int) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		k, ok := strings.CutPrefix(e.Name(), "channel")
		if !ok {
			continue
		}
		if i, err := strconv.Atoi(k); err == nil && i >= count {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	for i := range count {
		p := filepath.Join(dir, "channel"+strconv.Itoa(i))
		err := mknodChar(p, imexChannelsMajor, uint32(i))
		switch {
		case errors.Is(err, fs.ErrExist):
			continue
		case errors.Is(err, fs.ErrPermission):
			return fmt.Errorf("mknod %s: %w (making device nodes needs CAP_MKNOD)", p, err)
		case err != nil:
			return fmt.Errorf("mknod %s: %w", p, err)
		}
		// Set apart from mknod, which the process-wide umask trims: the
		// driver's nodes are 0666.
		if err := os.Chmod(p, 0o666); err != nil {
			return err
		}
	}
	return nil
}
