; Inno Setup script: the Windows installer of the desktop download, with its Start-menu entry.
; Build dist\finetune-studio with `python packaging\build_bundle.py` first, then:
;   iscc /DAppVersion=0.1.0 packaging\windows\finetune-studio.iss     -> dist\finetune-studio-setup.exe
; It installs per user (no administrator rights); the training runtime lives in the user's data folder
; (%LOCALAPPDATA%\finetune-studio\runtime) and is left in place on uninstall, like the user's runs.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif

[Setup]
AppId=org.finetune-studio.app
AppName=Finetune Studio
AppVersion={#AppVersion}
AppPublisher=Finetune Studio
DefaultDirName={localappdata}\Programs\Finetune Studio
DefaultGroupName=Finetune Studio
PrivilegesRequired=lowest
OutputDir=..\..\dist
OutputBaseFilename=finetune-studio-setup
Compression=lzma2
SolidCompression=yes
ArchitecturesInstallIn64BitMode=x64compatible
UninstallDisplayIcon={app}\finetune-studio.exe

[Files]
Source: "..\..\dist\finetune-studio\*"; DestDir: "{app}"; Flags: recursesubdirs ignoreversion

[Icons]
Name: "{group}\Finetune Studio"; Filename: "{app}\finetune-studio.exe"
Name: "{autodesktop}\Finetune Studio"; Filename: "{app}\finetune-studio.exe"; Tasks: desktopicon

[Tasks]
Name: "desktopicon"; Description: "Create a desktop shortcut"; Flags: unchecked

[Run]
Filename: "{app}\finetune-studio.exe"; Description: "Start Finetune Studio"; Flags: nowait postinstall skipifsilent
