{{/* Object names: "<release>-<chart>", or the release name alone when it holds the chart's. */}}
{{- define "kvrelay.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>", kept within the 63 characters of a DNS label. */}}
{{- define "kvrelay.name" -}}
{{- printf "%s-%s" (include "kvrelay.fullname" .root | trunc (int (sub 62 (len .suffix))) | trimSuffix "-") .suffix -}}
{{- end -}}

{{- define "kvrelay.controlplane" -}}{{ include "kvrelay.name" (dict "root" . "suffix" "controlplane") }}{{- end -}}
{{- define "kvrelay.proxy" -}}{{ include "kvrelay.name" (dict "root" . "suffix" "proxy") }}{{- end -}}

{{/* Labels that select one component's pods: root and component in a dict. */}}
{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ default .root.Chart.Name .root.Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object of one component: root and component in a dict. */}}
{{- define "kvrelay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvrelay
{{- end -}}

{{- define "kvrelay.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvrelay.discoveryNamespace" -}}
{{ .Values.discovery.namespace | default .Release.Namespace }}
{{- end -}}

{{- define "kvrelay.apiTokenSecret" -}}
{{- if .Values.apiToken.existingSecret -}}
{{ .Values.apiToken.existingSecret }}
{{- else -}}
{{ include "kvrelay.name" (dict "root" . "suffix" "api-token") }}
{{- end -}}
{{- end -}}

{{- define "kvrelay.apiTokenKey" -}}
{{- if .Values.apiToken.existingSecret -}}
{{ .Values.apiToken.existingSecretKey }}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/* The xDS address proxies dial: the control plane Service's name in its namespace, which
the xDS certificate (the chart's, or xds.tlsSecret) carries. */}}
{{- define "kvrelay.xdsHost" -}}
{{ include "kvrelay.controlplane" . }}.{{ .Release.Namespace }}.svc
{{- end -}}

{{/* The Secret (kubernetes.io/tls with ca.crt) of the xDS listener's certificate:
xds.tlsSecret, else the one the chart generates. */}}
{{- define "kvrelay.xdsTLSSecret" -}}
{{- if .Values.xds.tlsSecret -}}
{{ .Values.xds.tlsSecret }}
{{- else -}}
{{ include "kvrelay.name" (dict "root" . "suffix" "xds-tls") }}
{{- end -}}
{{- end -}}

{{/* The proxies' ServiceAccount: the identity their xDS tokens carry. */}}
{{- define "kvrelay.proxyServiceAccount" -}}{{ include "kvrelay.proxy" . }}{{- end -}}

{{/* Soft anti-affinity by host: spread a component's replicas over nodes where the
scheduler can, without leaving a pod pending where it cannot. root and component in a dict. */}}
{{- define "kvrelay.affinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kvrelay.selectorLabels" . | nindent 12 }}
{{- end -}}

{{/* GOMAXPROCS from the container's CPU request (rounded up to whole cores): without a CPU
limit Go would size its scheduler, and the proxy its event loops, to the node's cores. */}}
{{- define "kvrelay.gomaxprocs" -}}
- name: GOMAXPROCS
  valueFrom:
    resourceFieldRef:
      resource: requests.cpu
      divisor: "1"
{{- end -}}
