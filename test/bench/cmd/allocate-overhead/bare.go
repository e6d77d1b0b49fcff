package main

import (
	"context"
	"net"
	"slices"
	"strings"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// barePlugin is the floor an agent is measured against: a device plugin
// that does nothing but answer. Allocate gives every container the same
// devices and the requested IDs as NVIDIA_VISIBLE_DEVICES, which is what a
// whole-GPU answer holds; GetPreferredAllocation takes the must-include IDs
// and then the first available ones.
type barePlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	srv     *grpc.Server
}

// bareDeviceNodes are the device nodes of a whole-GPU answer: the control
// nodes, then the GPU's own.
var bareDeviceNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0"}

// startBarePlugin serves a bare plugin of devices ids on socket until stop.
func startBarePlugin(socket string, ids []string) (*barePlugin, error) {
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	p := &barePlugin{srv: grpc.NewServer()}
	for _, id := range ids {
		p.devices = append(p.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	pluginapi.RegisterDevicePluginServer(p.srv, p)
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

func (p *barePlugin) stop() { p.srv.Stop() }

// GetDevicePluginOptions implements [pluginapi.DevicePluginServer.GetDevicePluginOptions].
func (p *barePlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

// ListAndWatch implements [pluginapi.DevicePluginServer.ListAndWatch]: the
// list once, then nothing until the stream ends.
func (p *barePlugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

// Allocate implements [pluginapi.DevicePluginServer.Allocate].
func (p *barePlugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.GetContainerRequests() {
		cr := &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.GetDevicesIds(), ",")},
		}
		for _, n := range bareDeviceNodes {
			cr.Devices = append(cr.Devices, &pluginapi.DeviceSpec{ContainerPath: n, HostPath: n, Permissions: "rw"})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cr)
	}
	return resp, nil
}

// GetPreferredAllocation implements [pluginapi.DevicePluginServer.GetPreferredAllocation].
func (p *barePlugin) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range req.GetContainerRequests() {
		n := int(c.GetAllocationSize())
		ids := slices.Clone(c.GetMustIncludeDeviceIDs())
		for _, id := range c.GetAvailableDeviceIDs() {
			if len(ids) >= n {
				break
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids[:min(n, len(ids))]})
	}
	return resp, nil
}

// PreStartContainer implements [pluginapi.DevicePluginServer.PreStartContainer].
func (p *barePlugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
